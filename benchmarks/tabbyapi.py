"""TabbyAPI (its last commit with the exllamav2 backend, 79126f9) served by exlpy, unmodified.

    python benchmarks/tabbyapi.py --tabby /path/to/tabbyAPI-79126f9 --model MODEL_DIR [--draft-model DIR]
        [--venv DIR] [--wheelhouse DIR] [--no-install] [--out benchmarks/results/tabbyapi.md]
        [--budget SECONDS] [--only lora,json] [--random-weights] [--save-log FILE]

What it does, in order:
1. A virtual environment (default /tmp/exlpy-tabby-venv) that sees this interpreter's packages (torch, exlpy's
   dependencies) through a .pth line, and this exlpy checkout.
2. TabbyAPI's dependencies (its pyproject.toml) installed into it with pip, best effort: from PyPI, or with
   `--wheelhouse DIR` from wheels only (`--download-wheels DIR` fills such a folder on a machine with network,
   for a GPU machine without one). Packages this interpreter already has are not installed again.
3. `exlpy compat install` into that environment: `import exllamav2` is exlpy there, with exllamav2's
   distribution metadata (TabbyAPI checks for it).
4. TabbyAPI started with its own entry point (`python main.py --config CONFIG`, from the checkout, nothing in it
   changed; CONFIG, the model links and a LoRA adapter live in a temporary folder).
5. The OpenAI client drives it: models, chat, completions, streaming, JSON schema, tools, LoRA load/unload,
   model unload/load, a draft model; each check is recorded with its result and time in the results file.

Model: any exlpy-loadable directory (fp16 or EXL2). The LoRA adapter is a random rank-8 PEFT adapter written
for the model's shapes (its effect is checked, not its quality). The draft model defaults to the model itself.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "tabbyapi.md"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# ----------------------------------------------------------------------------------------------- environment
def child_env(**extra: str) -> dict[str, str]:
    """The environment of the venv's processes: no PYTHONPATH (its entries would come before the venv's own
    packages, e.g. another pydantic than the one TabbyAPI pins); the venv's .pth lines put exlpy on the path."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "EXLPY_NO_CPU_WARNING": "1", **extra}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def make_venv(venv: Path) -> Path:
    py = venv_python(venv)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=child_env()).stdout.strip())
    # This interpreter's packages come after the venv's own (so a pin TabbyAPI needs can shadow them), and this
    # exlpy checkout before both. Every site directory it has: a distribution's Python keeps pip-installed
    # packages in one (/usr/local/lib/python3.X/dist-packages) and its own in another (/usr/lib/python3/...).
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"], *(p for p in sys.path if p.rstrip("/").endswith(
        ("site-packages", "dist-packages")))]
    (site / "_exlpy_parent.pth").write_text("\n".join([str(ROOT), *dict.fromkeys(dirs)]) + "\n")
    return site


def mask_torch_cuda13(site: Path, log: list[str]) -> None:
    """TabbyAPI 79126f9 turns its exllamav2 backend off when torch's distribution version ends in `+cu13...`
    (`common/optional_dependencies.py: is_torch_cuda_13`): exllamav2's compiled wheels were never built for CUDA 13.
    exlpy compiles nothing ahead of time, so the guard does not apply to it; a metadata-only `torch` dist-info in the
    venv's site-packages (found before this interpreter's own) reports the version without its local label. torch
    itself is not touched: `import torch` still loads this interpreter's build."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        full = version("torch")
    except PackageNotFoundError:
        return
    public, _, local = full.partition("+")
    for old in site.glob("torch-*.dist-info"):
        if (old / "EXLPY_MASK").exists():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    if not local.startswith("cu13"):
        return
    info = site / f"torch-{public}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {public}\n")
    (info / "EXLPY_MASK").write_text(f"masks torch {full} for TabbyAPI's is_torch_cuda_13 guard\n")
    log.append(f"torch {full}: the venv reports torch {public} (a metadata-only dist-info), since TabbyAPI "
               "79126f9 disables its exllamav2 backend for +cu13 torch builds (exllamav2's compiled wheels; exlpy "
               "has none)")


def tabby_requirements(tabby: Path) -> list[str]:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with open(tabby / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def install_deps(py: Path, reqs: list[str], wheelhouse: Path | None, log: list[str]) -> bool:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", "install", "--quiet", *reqs]
    if wheelhouse is not None:
        cmd[5:5] = ["--no-index", "--find-links", str(wheelhouse)]
    log.append("$ " + " ".join(cmd[2:]))
    res = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if res.returncode != 0:
        log.append("pip failed (best effort, continuing): " + (res.stderr.strip().splitlines() or ["?"])[-1])
        return False
    return True


def download_wheels(reqs: list[str], dest: Path, python_version: str | None) -> None:
    """Wheels of TabbyAPI's dependencies and theirs (and the openai client's, for the driver) for an offline
    x86-64 Linux machine running `python_version` (default: this interpreter's). pip on that machine installs
    only what its environment lacks from them (`--wheelhouse`)."""
    dest.mkdir(parents=True, exist_ok=True)
    target = []
    if python_version:
        target = ["--python-version", python_version, "--implementation", "cp"]
        for plat in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                     "manylinux2014_x86_64", "manylinux1_x86_64"):
            target += ["--platform", plat]
    subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary=:all:", *target, "-d", str(dest),
                    *reqs, "openai", "httpx"], check=True)


def alias_install(py: Path, log: list[str]) -> None:
    res = subprocess.run([str(py), "-m", "exlpy.cli.main", "compat", "install"], capture_output=True, text=True,
                         env=child_env())
    log.append("$ exlpy compat install: " + (res.stdout.strip() or res.stderr.strip()))
    if res.returncode != 0:
        raise SystemExit(f"exlpy compat install failed:\n{res.stderr}")


# ----------------------------------------------------------------------------------------------- fixtures
def write_lora(model_dir: Path, dest: Path, r: int = 8, std: float = 0.05) -> None:
    """A random PEFT LoRA adapter (q_proj, v_proj of every layer) with the model's shapes; `std`: of A and B's
    entries (0.05 moves a trained model's output; a random-weight model's needs more)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads) * d
    g = torch.Generator().manual_seed(0)
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        for proj, out in (("q_proj", heads * d), ("v_proj", kv)):
            p = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            t[f"{p}.lora_A.weight"] = (torch.randn(r, h, generator=g) * std).half()
            t[f"{p}.lora_B.weight"] = (torch.randn(out, r, generator=g) * std).half()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(t, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}))


def write_config(work: Path, model: Path, draft: Path | None, port: int, max_seq_len: int,
                 tool_format: str | None) -> Path:
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    for src in {model, draft} - {None}:
        link = models / src.name  # type: ignore[union-attr]
        if not link.exists():
            link.symlink_to(src)
    lines = [
        "network:", "  host: 127.0.0.1", f"  port: {port}", "  disable_auth: true", "  send_tracebacks: true",
        "logging:", "  log_prompt: false", "  log_requests: false",
        "model:", f"  model_dir: {models}", f"  model_name: {model.name}", "  backend: exllamav2",
        f"  max_seq_len: {max_seq_len}", "  cache_mode: FP16", "  chunk_size: 512",
        *([f"  tool_format: {tool_format}"] if tool_format else []),
        "draft_model:", f"  draft_model_dir: {models}",
        "lora:", f"  lora_dir: {work / 'loras'}",
        "sampling:", "  override_preset: safe_defaults",
        # TabbyAPI's default switches torch to cudaMallocAsync; exlpy captures CUDA graphs, which want torch's own
        # caching allocator, so the run keeps the default allocator.
        "memory:", "  cuda_malloc_async: false",
    ]
    path = work / "config.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------------------------- the checks
class Skipped(Exception):
    """A check that cannot apply to this model or set-up (the reason is recorded)."""


class Checks:
    """The checks' rows, written to the results file after each one (a run stopped from outside keeps what it
    did). Past `deadline` (time.monotonic()) a check is not started: it is recorded as skipped."""

    def __init__(self, deadline: float = float("inf"), on_row: Callable[[], None] = lambda: None) -> None:
        self.rows: list[tuple[str, str, float, str]] = []  # name, ok / failed / skipped, seconds, detail
        self.deadline, self.on_row = deadline, on_row
        self.current: str | None = None
        self.t0 = 0.0  # when the current check started

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Callable[[], str]) -> bool:
        t0 = self.t0 = time.perf_counter()
        self.current = name
        try:
            if self.left() <= 0:
                raise Skipped("not started: the run's time budget (--budget) was spent")
            detail, result = fn(), "ok"
        except Skipped as e:
            detail, result = str(e), "skipped"
        except Exception as e:  # a failing check is a finding, not the end of the run
            detail, result = f"{type(e).__name__}: {e}"[:400], "failed"
            traceback.print_exc()
        dt_s = time.perf_counter() - t0
        self.add(name, result, dt_s, detail)
        return result == "ok"

    def add(self, name: str, result: str, dt_s: float, detail: str) -> None:
        self.current = None
        self.rows.append((name, result, dt_s, detail.replace("\n", " ").replace("|", "\\|")[:300]))
        print(f"[{result}] {name} ({dt_s:.1f} s): {detail[:200]}", flush=True)
        self.on_row()


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"TabbyAPI exited with status {proc.returncode} before it was ready")
        try:
            r = httpx.get(base + "/health", timeout=2)
            if r.status_code == 200:
                r = httpx.get(base + "/v1/model", timeout=5)
                if r.status_code == 200 and r.json().get("id"):
                    return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"TabbyAPI not ready after {timeout:.0f} s")


def post_stream(base: str, path: str, body: dict[str, Any], timeout: float = 900) -> list[Any]:
    """POST to an admin endpoint that answers with server-sent events (model/load) or JSON."""
    import httpx

    with httpx.stream("POST", base + path, json=body, timeout=timeout) as r:
        text = "".join(r.iter_text())
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {text[:300]}")
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and
              line[5:].strip() not in ("", "[DONE]")]
    return events or [json.loads(text)]


def drive(base: str, model_name: str, draft_name: str | None, tool_format: str | None, checks: Checks,
          random_weights: bool = False, only: list[str] | None = None) -> None:
    """Each check in turn; `only`: the checks whose names contain one of these (case-insensitive)."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=600)
    chat = [{"role": "user", "content": "Name three colours."}]

    def models() -> str:
        ids = [m.id for m in client.models.list().data]
        assert model_name in ids, ids
        return f"/v1/models lists {ids}"

    def chat_completion() -> str:
        r = client.chat.completions.create(model=model_name, messages=chat, max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        assert text, r
        return f"finish {r.choices[0].finish_reason}: {text!r}"

    def completion() -> str:
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=24, temperature=0)
        assert r.choices[0].text, r
        return f"finish {r.choices[0].finish_reason}: {r.choices[0].text!r}"

    def streaming() -> str:
        parts = []
        for ev in client.chat.completions.create(model=model_name, messages=chat, max_tokens=24, stream=True,
                                                 temperature=0):
            if ev.choices and ev.choices[0].delta.content:
                parts.append(ev.choices[0].delta.content)
        assert len(parts) > 1, parts
        return f"{len(parts)} chunks: {''.join(parts)!r}"

    def n2() -> str:
        r = client.completions.create(model=model_name, prompt="The sky is", max_tokens=8, n=2, temperature=1.0)
        assert len(r.choices) == 2, r
        return f"n=2: {[c.text for c in r.choices]}"

    def json_schema() -> str:
        if random_weights:
            # formatron's JSON grammar leaves strings and whitespace unbounded, which a random-weight model fills
            # until max_tokens; a bounded regex goes through the same filter path and must end by EOS when done.
            r = client.chat.completions.create(
                model=model_name, max_tokens=60, temperature=0,
                messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
                extra_body={"regex_pattern": r'\{"name": "(Ada|Bob)", "age": [1-9][0-9]?\}'})
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            obj = json.loads(text)
            assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and finish == "stop", (text, finish)
            return f"random weights, so a bounded regex through formatron: finish {finish}, valid JSON {text!r}"
        r = client.chat.completions.create(
            model=model_name, max_tokens=120, temperature=0,
            messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
            extra_body={"json_schema": SCHEMA})  # TabbyAPI's field (its response_format takes the bare schema)
        text = r.choices[0].message.content
        obj = json.loads(text)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), obj
        return f"valid JSON: {text!r}"

    def tools() -> str:
        if not tool_format:
            raise Skipped("TabbyAPI parses tool calls only with model.tool_format set (qwen3_coder, mistral, ...), "
                          "for a model whose chat template renders tools; give --tool-format")
        r = client.chat.completions.create(
            model=model_name, max_tokens=80, temperature=0, tools=[WEATHER_TOOL], tool_choice="required",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        msg = r.choices[0].message
        assert msg.tool_calls, f"no tool call; finish {r.choices[0].finish_reason}, content {msg.content!r}"
        call = msg.tool_calls[0].function
        json.loads(call.arguments)
        return f"tool call {call.name}({call.arguments})"

    def concurrent() -> str:
        from concurrent.futures import ThreadPoolExecutor

        def one(i: int) -> str:
            r = client.completions.create(model=model_name, prompt=f"Story {i}: Once upon a time", max_tokens=16,
                                          temperature=0)
            return r.choices[0].text

        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, range(4)))
        assert all(texts), texts
        return f"4 requests at once, all answered in {time.perf_counter() - t0:.1f} s"

    def banned_strings() -> str:
        base = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16,
                                         temperature=0).choices[0].text
        words = sorted((w.strip(",.") for w in base.split()), key=len, reverse=True)
        if not words or len(words[0]) < 2:
            raise Skipped(f"no word to ban in the greedy text {base!r}")
        word = words[0]
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"banned_strings": [word]})
        text = r.choices[0].text
        assert word.lower() not in text.lower() and text, (word, text)
        return f"banned {word!r}: {text!r}"

    def token_healing() -> str:
        r = client.completions.create(model=model_name, prompt="The capital of France is Par", max_tokens=8,
                                      temperature=0, extra_body={"token_healing": True})
        assert r.choices[0].text, r
        return f"'...Par' + {r.choices[0].text!r}"

    def cfg() -> str:
        card = httpx.get(base + "/v1/model", timeout=10).json()
        if (card.get("parameters") or {}).get("max_batch_size", 1) <= 1:
            raise Skipped("TabbyAPI disables CFG without paged attention (its compatibility mode: no CUDA device)")
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"cfg_scale": 1.5, "negative_prompt": "sad"})
        assert r.choices[0].text
        return f"cfg_scale 1.5: {r.choices[0].text!r}"

    def quantized_cache() -> str:
        out = []
        for mode in ("Q4", "Q8"):
            httpx.post(base + "/v1/model/unload", json={}, timeout=60)
            post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048, "cache_mode": mode})
            card = httpx.get(base + "/v1/model", timeout=10).json()
            assert (card.get("parameters") or {}).get("cache_mode") == mode, card
            out.append(f"{mode}: {greedy_text()!r}")
        return "; ".join(out)

    def greedy_text() -> str:
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0)
        return r.choices[0].text

    def scored_text() -> tuple[str, list[float]]:
        """Greedy text and its tokens' log-probabilities (a random-weight model can repeat one token whatever
        an adapter adds; its log-probabilities still move)."""
        r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      logprobs=1)
        lp = r.choices[0].logprobs
        return r.choices[0].text, [float(x) for x in (lp.token_logprobs if lp and lp.token_logprobs else [])]

    def lora() -> str:
        before, lp_before = scored_text()
        res = post_stream(base, "/v1/lora/load", {"loras": [{"name": "random-r8", "scaling": 1.0}]})
        assert res[-1].get("success") == ["random-r8"], res
        listed = httpx.get(base + "/v1/lora", timeout=10).json()
        with_lora, lp_lora = scored_text()
        r = httpx.post(base + "/v1/lora/unload", json={}, timeout=60)
        assert r.status_code == 200, r.text
        after, lp_after = scored_text()
        moved = max((abs(a - b) for a, b in zip(lp_lora, lp_before)), default=0.0)
        back = max((abs(a - b) for a, b in zip(lp_after, lp_before)), default=0.0)
        assert (with_lora != before or moved > 1e-3) and after == before and back < 1e-3, \
            (before, with_lora, after, moved, back)
        scale = [c.get("scaling") for c in listed.get("data", [])]
        change = "output changes" if with_lora != before else f"same text, log-probabilities move by {moved:.3g}"
        return (f"load -> {change}, unload -> back to the base output (log-probabilities within {back:.1g}); "
                f"/v1/lora scaling {scale}")

    def unload_load() -> str:
        r = httpx.post(base + "/v1/model/unload", json={}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(base + "/v1/model", timeout=10).status_code != 200 or True
        ev = post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048})
        text = greedy_text()
        assert text, "no text after reload"
        return f"unload, load ({len(ev)} progress events), then {text!r}"

    def draft() -> str:
        if draft_name is None:
            raise RuntimeError("no draft model")
        httpx.post(base + "/v1/model/unload", json={}, timeout=60)
        post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048})
        plain = greedy_text()
        httpx.post(base + "/v1/model/unload", json={}, timeout=60)
        post_stream(base, "/v1/model/load", {"model_name": model_name, "max_seq_len": 2048,
                                             "draft_model": {"draft_model_name": draft_name}})
        card = httpx.get(base + "/v1/model", timeout=10).json()
        assert (card.get("parameters") or {}).get("draft"), card
        text = greedy_text()
        assert text == plain, ("speculative decoding changed the greedy text", plain, text)
        return f"draft {draft_name} loaded; greedy text unchanged by drafting: {text!r}"

    for name, fn in (("models list", models), ("chat completion", chat_completion), ("completion", completion),
                     ("streaming chat", streaming), ("n=2", n2), ("JSON schema (formatron filter)", json_schema),
                     ("tools (tool_choice=required)", tools), ("concurrent requests", concurrent),
                     ("banned strings", banned_strings), ("token healing", token_healing), ("CFG", cfg),
                     ("LoRA load / unload", lora), ("model unload / load", unload_load),
                     ("Q4 / Q8 cache", quantized_cache), ("draft model", draft)):
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        checks.run(name, fn)


# ----------------------------------------------------------------------------------------------- report
def write_results(out: Path, args: argparse.Namespace, checks: Checks, setup_log: list[str], device: str,
                  log_tail: str) -> None:
    title = f"## TabbyAPI {args.commit} on exlpy: {device}, {args.model.name}"
    passed = sum(r == "ok" for _, r, _, _ in checks.rows)
    skipped = sum(r == "skipped" for _, r, _, _ in checks.rows)
    lines = [
        title,
        "",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. Host: {platform.node()}, Python "
        f"{platform.python_version()}. Model: `{args.model}`; draft: `{args.draft_model or args.model}`.",
        "",
        f"Command: `python benchmarks/tabbyapi.py --tabby {args.tabby} --model {args.model}"
        + (f" --draft-model {args.draft_model}" if args.draft_model else "")
        + (f" --wheelhouse {args.wheelhouse}" if args.wheelhouse else "")
        + (f" --budget {args.budget:.0f}" if args.budget else "") + "`",
        "",
        "TabbyAPI started unmodified with `python main.py --config CONFIG` in a virtual environment where "
        "`exlpy compat install` aliases exllamav2 to exlpy.",
        "",
        f"**{passed} of {len(checks.rows) - skipped} checks passed** ({skipped} skipped).",
        "",
        "| check | result | time | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {r if r != 'failed' else '**failed**'} | {t:.1f} s | {d} |" for n, r, t, d in checks.rows]
    lines += ["", "Set-up:", "", "```", *setup_log, "```", ""]
    if log_tail:
        lines += ["<details><summary>TabbyAPI log (tail)</summary>", "", "```", log_tail, "```", "</details>", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = out.read_text() if out.exists() else "# TabbyAPI on exlpy\n\n"
    if title in previous:  # replace this device's and model's section, keep the others
        head, _, rest = previous.partition(title)
        nxt = rest.find("\n## ")
        previous = head + (rest[nxt + 1:] if nxt >= 0 else "")
    out.write_text(previous.rstrip() + "\n\n" + "\n".join(lines))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit("SIGTERM")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tabby", type=Path, required=True, help="TabbyAPI checkout (commit 79126f9)")
    p.add_argument("--model", type=Path, default=ROOT.parent / "shared" / "models" / "smollm2-135m-exl2-4.0")
    p.add_argument("--draft-model", type=Path, default=None, help="draft model (default: the model itself)")
    p.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "exlpy-tabby-venv")
    p.add_argument("--wheelhouse", type=Path, default=None, help="install TabbyAPI's dependencies from here only")
    p.add_argument("--download-wheels", type=Path, default=None, help="only download the wheels into this folder")
    p.add_argument("--wheel-python", default=None, help="with --download-wheels: the target machine's Python "
                   "version, e.g. 3.12")
    p.add_argument("--no-install", action="store_true", help="do not pip-install TabbyAPI's dependencies")
    p.add_argument("--port", type=int, default=5057)
    p.add_argument("--tool-format", default=None, help="TabbyAPI's model.tool_format (e.g. qwen3_coder) for the "
                   "tools check; without it the check is skipped")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run, set-up included: "
                   "checks not started by then are recorded as skipped, and the results file is written")
    p.add_argument("--random-weights", action="store_true", help="the model has random weights (its text is noise): "
                   "the structured-output check uses a bounded regex instead of an unbounded JSON schema")
    p.add_argument("--only", default=None, help="comma-separated parts of check names: run only those checks")
    p.add_argument("--save-log", type=Path, default=None, help="copy TabbyAPI's whole log here")
    p.add_argument("--commit", default="79126f9")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    tabby, model = args.tabby.resolve(), args.model.resolve()
    draft = (args.draft_model or args.model).resolve()
    reqs = tabby_requirements(tabby)
    if args.download_wheels:
        download_wheels(reqs, args.download_wheels, args.wheel_python)
        return 0

    t_start = time.monotonic()
    deadline = t_start + args.budget if args.budget else float("inf")
    # A `timeout` from outside (SIGTERM) ends the run the same way as the budget: TabbyAPI stopped, results written.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    setup_log: list[str] = []
    site = make_venv(args.venv)
    py = venv_python(args.venv)
    setup_log.append(f"venv {args.venv} (site-packages {site})")
    if not args.no_install:
        install_deps(py, [*reqs, "openai"], args.wheelhouse, setup_log)
    mask_torch_cuda13(site, setup_log)
    alias_install(py, setup_log)
    setup_log.append(f"set-up took {time.monotonic() - t_start:.0f} s")
    for line in setup_log:
        print("setup:", line[:300], flush=True)
    sys.path.append(str(site))  # the driver's openai client, where this interpreter has none (after its own)

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    work = Path(tempfile.mkdtemp(prefix="exlpy-tabby-"))
    write_lora(model, work / "loras" / "random-r8", std=0.2 if args.random_weights else 0.05)
    cfg = write_config(work, model, draft, args.port, args.max_seq_len, args.tool_format)
    log_path = work / "tabby.log"
    env = child_env(PYTHONUNBUFFERED="1")

    def log_tail() -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:]) if log_path.exists() else ""

    checks = Checks(deadline, lambda: write_results(args.out, args, checks, setup_log, device, log_tail()))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(py), "main.py", "--config", str(cfg)], cwd=tabby, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        startup = min(args.startup_timeout, max(checks.left(), 1.0))
        if checks.run("start and load the model", lambda: (wait_ready(base, proc, startup), f"ready at {base}")[1]):
            drive(base, model.name, draft.name, args.tool_format, checks, args.random_weights,
                  args.only.split(",") if args.only else None)
    except BaseException as e:  # stopped from outside (SIGTERM, Ctrl-C): record where
        if checks.current is not None:
            checks.add(checks.current, "failed", time.perf_counter() - checks.t0,
                       f"interrupted ({type(e).__name__}: {e}; --budget {args.budget or 0:.0f} s)")
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):  # TabbyAPI may have exited by itself
            os.killpg(proc.pid, signal.SIGTERM)
        write_results(args.out, args, checks, setup_log, device, log_tail())  # first: a kill may follow soon
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if args.save_log:
            args.save_log.write_bytes(log_path.read_bytes())
        print(f"results: {args.out}; work dir {work}; {time.monotonic() - t_start:.0f} s in all", flush=True)
    return 0 if all(r != "failed" for _, r, _, _ in checks.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
