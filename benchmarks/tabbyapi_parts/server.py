"""TabbyAPI's process: the files it is started with (config.yml, model links, a random LoRA adapter), its start
with its own entry point (`python main.py --config CONFIG` from the checkout, nothing in it changed), the wait
until it serves the model, and its stop (the whole process group)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path


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


TOOLS_TEMPLATE = Path(__file__).resolve().parent / "chatml_tools.jinja"


def write_config(work: Path, model: Path, draft: Path | None, port: int, max_seq_len: int,
                 tool_format: str | None, prompt_template: Path | None = None) -> Path:
    """TabbyAPI's config.yml. `prompt_template`: a template file, given as model.prompt_template (TabbyAPI looks
    for `templates/NAME` from its checkout, and an absolute path stays itself); None: the model's own template."""
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    for src in {model, draft} - {None}:
        link = models / src.name  # type: ignore[union-attr]
        if not link.exists():
            link.symlink_to(src)
    lines = [
        "network:", "  host: 127.0.0.1", f"  port: {port}", "  disable_auth: true", "  send_tracebacks: true",
        # TabbyAPI's default, written out: its validator lower-cases a given list but not the default ["OAI"], and
        # /v1/token/encode with chat messages (the tools check) asks for "oai" (endpoints/core/router.py:405).
        "  api_servers: [oai]",
        "logging:", "  log_prompt: false", "  log_requests: false",
        "model:", f"  model_dir: {models}", f"  model_name: {model.name}", "  backend: exllamav2",
        f"  max_seq_len: {max_seq_len}", "  cache_mode: FP16", "  chunk_size: 512",
        *([f"  tool_format: {tool_format}"] if tool_format else []),
        *([f"  prompt_template: {prompt_template.resolve()}"] if prompt_template else []),
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


def start(py: Path, tabby: Path, cfg: Path, log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """TabbyAPI started from its checkout in its own session (so that `stop` reaches its children), its output
    into `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen([str(py), "main.py", "--config", str(cfg)], cwd=tabby, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


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


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to TabbyAPI's process group (it unloads the model and exits)."""
    with contextlib.suppress(ProcessLookupError):  # TabbyAPI may have exited by itself
        os.killpg(proc.pid, signal.SIGTERM)


def reap(proc: subprocess.Popen[bytes], grace: float = 10) -> None:
    """Wait `grace` seconds for a terminated TabbyAPI, then SIGKILL its process group."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
