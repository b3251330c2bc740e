"""Every entry point on two real GPUs, for each way of placing a model (marker `multigpu`; skipped without two
CUDA devices). Fake CPU devices cannot see cross-device streams, events or peer copies, so these run only where
two GPUs are visible (`bash benchmarks/gpu_tests.sh` on a two-GPU machine runs them with the rest).

Placements: `load_autosplit` (balanced over both GPUs), a manual `gpu_split`, and `load_tp` (tensor
parallelism). Formats: fp16 (a random Llama with the demo model's tokenizer) and EXL2 (`../shared`'s tiny EXL2,
converted by exllamav2). Each placement is compared with the same model on one GPU, CUDA graphs on (the
default): logits of a prefill and 64 teacher-forced decode steps, 64 greedy tokens, the streaming generator,
the dynamic generator with 8 concurrent jobs, a LoRA adapter, speculative decoding, a grammar filter and the
OpenAI server's completion route.

Greedy tokens of two fp16 runs may part where the reference's top two logits are within rounding noise:
`assert_same_greedy` accepts a divergence only there.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora, ExLlamaV2Tokenizer
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.generator import (
    ExLlamaV2DynamicGenerator,
    ExLlamaV2DynamicJob,
    ExLlamaV2Sampler,
    ExLlamaV2StreamingGenerator,
)

sys.path.insert(0, str(Path(__file__).parent))
from conftest import rel_err, shared_path  # noqa: E402
from lora_util import write_adapter  # noqa: E402
from tp_util import make_model_dir  # noqa: E402

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

GREEDY = ExLlamaV2Sampler.Settings.greedy()
PROMPTS = ["Echoes of", "Once", "The gentle hum of", "A", "Vectors align, and", "In the quiet", "Precision", "Why"]
PLACEMENTS = ["autosplit", "gpu_split", "tp"]
FORMATS = ["fp16", "exl2"]
TIE = 0.05  # fp16 logits of two placements differ by ~1e-2; a greedy step closer than this may flip


def _model_dir(fmt: str, root: Path) -> Path:
    if fmt == "exl2":
        return shared_path("models", "tiny-llama-exl2-4.0")
    from exlpy.demo import DEMO_MODEL_DIR

    d = make_model_dir(root / "fp16", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024,
                       vocab=512, layers=4, dtype=torch.float16, seed=11)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEMO_MODEL_DIR) / name, d / name)
    return d


def _load(path: Path, placement: str | None, max_seq_len: int = 1024) -> tuple[ExLlamaV2, Any]:
    cfg = ExLlamaV2Config(str(path))
    cfg.max_seq_len = max_seq_len
    model = ExLlamaV2(cfg)
    if placement is None:
        model.load(device="cuda:0")
        cache = ExLlamaV2Cache(model, max_seq_len=max_seq_len)
    elif placement == "tp":
        model.load_tp([1, 1])
        cache = ExLlamaV2Cache_TP(model, max_seq_len=max_seq_len)
    elif placement == "autosplit":
        cache = ExLlamaV2Cache(model, max_seq_len=max_seq_len, lazy=True)
        model.load_autosplit(cache)
    else:
        half = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2 / 1024**3
        model.load(gpu_split=[half, 100])  # about half of the weights on GPU 0, the rest on GPU 1
        cache = ExLlamaV2Cache(model, max_seq_len=max_seq_len)
    if placement is not None:
        devices = {str(d) for d in model.strategy_for_forward().devices}
        assert {"cuda:0", "cuda:1"} <= devices, f"{placement} used {devices}"
    return model, cache


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = _model_dir(request.param, tmp_path_factory.mktemp(request.param))
    ref, ref_cache = _load(path, None)
    tok = ExLlamaV2Tokenizer(ref.config)
    out = {"name": request.param, "path": path, "ref": ref, "ref_cache": ref_cache, "tok": tok}
    yield out
    ref.unload()


@pytest.fixture(scope="module", params=PLACEMENTS)
def placed(request: pytest.FixtureRequest, fmt: dict[str, Any]) -> dict[str, Any]:
    model, cache = _load(fmt["path"], request.param)
    yield {**fmt, "placement": request.param, "model": model, "cache": cache}
    model.unload()
    torch.cuda.empty_cache()


def _new_cache(p: dict[str, Any], model: ExLlamaV2, max_seq_len: int = 1024) -> Any:
    if p["placement"] == "tp" and model is p["model"]:
        return ExLlamaV2Cache_TP(model, max_seq_len=max_seq_len)
    return ExLlamaV2Cache(model, max_seq_len=max_seq_len)


def _ids(tok: ExLlamaV2Tokenizer, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    text = tok.encode(" ".join(PROMPTS), add_bos=True)[:, :n // 2]
    extra = torch.randint(3, tok.get_vocab_size() - 1, (1, n - text.shape[1]), generator=g)
    return torch.cat([text, extra], dim=1)


def assert_same_greedy(ref: ExLlamaV2, prompt: torch.Tensor, a: list[int], b: list[int]) -> None:
    """a == b, except after a position where the reference model's logits for a[i] and b[i] are within TIE."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            seq = torch.cat([prompt.view(1, -1), torch.tensor([a[:i]], dtype=torch.long)], dim=1)
            logits = ref.forward(seq)[0, -1].float()
            gap = abs(float(logits[a[i]] - logits[b[i]]))
            assert gap < TIE, f"greedy tokens part at {i} ({a[i]} vs {b[i]}) where the logits differ by {gap}"
            return
    assert len(a) == len(b), (len(a), len(b))


def _greedy(model: ExLlamaV2, cache: Any, ids: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    cache.current_seq_len = 0
    logits = model.forward(ids, cache, last_id_only=True)[:, -1]
    out = []
    for _ in range(n):
        t = int(logits.argmax(-1))
        out.append(t)
        logits = model.forward(torch.tensor([[t]]), cache)[:, -1]
    return out, logits


def test_forward_logits_and_greedy_tokens(placed: dict[str, Any]) -> None:
    """Prefill + 64 teacher-forced decode steps (each a captured step) equal the one-GPU logits; 64 greedy
    tokens equal."""
    ref, m, tok = placed["ref"], placed["model"], placed["tok"]
    ids = _ids(tok)
    forced = torch.randint(3, tok.get_vocab_size() - 1, (1, 64), generator=torch.Generator().manual_seed(1))
    outs = []
    for model, cache in ((ref, placed["ref_cache"]), (m, placed["cache"])):
        cache.current_seq_len = 0
        steps = [model.forward(ids, cache)[0].float().cpu()]
        for t in range(64):
            steps.append(model.forward(forced[:, t:t + 1], cache)[0].float().cpu())
        outs.append(torch.cat(steps))
    assert rel_err(outs[1], outs[0]) < 1e-2, placed["placement"]
    runner = m.strategy.graph_cache.get("runner")
    assert runner is not None and any(s.captured for s in runner.steps.values()), "decode did not run captured"
    a, _ = _greedy(ref, placed["ref_cache"], ids, 64)
    b, _ = _greedy(m, placed["cache"], ids, 64)
    assert_same_greedy(ref, ids, a, b)


def test_streaming_generator(placed: dict[str, Any]) -> None:
    texts = []
    for model, cache in ((placed["ref"], placed["ref_cache"]), (placed["model"], placed["cache"])):
        sg = ExLlamaV2StreamingGenerator(model, cache, placed["tok"])
        sg.set_stop_conditions([])
        ids = placed["tok"].encode(PROMPTS[0], add_bos=True)
        sg.begin_stream_ex(ids, GREEDY)
        toks: list[int] = []
        while len(toks) < 32:
            r = sg.stream_ex()
            toks.extend(r["chunk_token_ids"].view(-1).tolist())
            if r["eos"]:
                break
        texts.append((ids, toks[:32]))
    assert_same_greedy(placed["ref"], texts[0][0], texts[0][1], texts[1][1])


def _dynamic(model: ExLlamaV2, cache: Any, tok: ExLlamaV2Tokenizer, jobs: list[ExLlamaV2DynamicJob],
             **kw: Any) -> dict[Any, list[int]]:
    gen = ExLlamaV2DynamicGenerator(model, cache, tok, **kw)
    gen.enqueue(jobs)
    out: dict[Any, list[int]] = {j: [] for j in jobs}
    ends: dict[Any, str] = {}
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] == "streaming" and "token_ids" in r:
                out[r["job"]].extend(r["token_ids"].view(-1).tolist())
            if r.get("eos"):
                ends[r["job"]] = r.get("eos_reason", "?") + (f": {r['error']!r}" if "error" in r else "")
    assert gen.page_table.num_unreferenced() == gen.num_pages  # every page back
    for j in jobs:  # a job ends by its budget or a stop token, never early for another reason
        assert ends.get(j) in ("max_new_tokens", "stop_token", "end_filter"), (ends.get(j), len(out[j]))
        assert ends[j] != "max_new_tokens" or len(out[j]) == j.max_new_tokens, (len(out[j]), j.max_new_tokens)
    return out


TOP_P = ExLlamaV2Sampler.Settings(temperature=1.0, top_k=0, top_p=0.9, token_repetition_penalty=1.0)


def _jobs(tok: ExLlamaV2Tokenizer, n: int = 24, sampled: int = 0, **kw: Any) -> list[ExLlamaV2DynamicJob]:
    """One greedy job per prompt, the last `sampled` of them seeded top-p instead (sampled on the device)."""
    return [ExLlamaV2DynamicJob(tok.encode(p, add_bos=True), n, stop_conditions=[], identifier=i,
                                gen_settings=TOP_P if i >= len(PROMPTS) - sampled else GREEDY, seed=i, **kw)
            for i, p in enumerate(PROMPTS)]


def test_dynamic_generator_eight_jobs(placed: dict[str, Any]) -> None:
    """8 concurrent jobs, 6 greedy (equal to the one-GPU run) and 2 seeded top-p (sampled on the logits' device:
    they run to their budget; their draws may part from the one-GPU run's at fp16 noise)."""
    tok = placed["tok"]
    ref = _dynamic(placed["ref"], _new_cache(placed, placed["ref"], 2048), tok, _jobs(tok, sampled=2))
    got = _dynamic(placed["model"], _new_cache(placed, placed["model"], 2048), tok, _jobs(tok, sampled=2))
    ref_by = {j.identifier: t for j, t in ref.items()}
    for j, toks in got.items():
        if j.identifier >= len(PROMPTS) - 2:
            continue
        assert_same_greedy(placed["ref"], tok.encode(PROMPTS[j.identifier], add_bos=True), ref_by[j.identifier],
                           toks)


def test_speculative_decoding(placed: dict[str, Any]) -> None:
    """n-gram speculation on the placed model gives the placed model's own greedy tokens."""
    tok, m = placed["tok"], placed["model"]
    plain = _dynamic(m, _new_cache(placed, m, 2048), tok, _jobs(tok, 32))
    spec = _dynamic(m, _new_cache(placed, m, 2048), tok, _jobs(tok, 32), use_ngram_draft=True,
                    num_draft_tokens=3)
    plain_by = {j.identifier: t for j, t in plain.items()}
    for j, toks in spec.items():
        assert_same_greedy(placed["ref"], tok.encode(PROMPTS[j.identifier], add_bos=True), plain_by[j.identifier],
                           toks)


def test_grammar_filter(placed: dict[str, Any]) -> None:
    pytest.importorskip("llguidance")
    from exlpy.generator.filters.grammar import ExLlamaV2GrammarFilter

    tok, m = placed["tok"], placed["model"]
    # A finite language: a random model must still end inside 40 tokens, where the filter forces the stop.
    pattern = r"(the|a|one) (big|small) (cat|dog|bird)s? (is|was) (here|there)\."
    outs = []
    for model in (placed["ref"], m):
        cache = _new_cache(placed, model, 2048)
        jobs = [ExLlamaV2DynamicJob(tok.encode(p, add_bos=True), 40, gen_settings=GREEDY,
                                    stop_conditions=[tok.eos_token_id], identifier=i,
                                    filters=[ExLlamaV2GrammarFilter.regex(model, tok, pattern)])
                for i, p in enumerate(PROMPTS[:4])]
        res = _dynamic(model, cache, tok, jobs)
        outs.append({j.identifier: t for j, t in res.items()})
    for i in range(4):
        text = tok.decode(torch.tensor([t for t in outs[1][i] if t != tok.eos_token_id]))
        assert re.fullmatch(pattern, text), text
        assert_same_greedy(placed["ref"], tok.encode(PROMPTS[i], add_bos=True), outs[0][i], outs[1][i])


def test_lora_adapter(placed: dict[str, Any], tmp_path: Path) -> None:
    adir = write_adapter(tmp_path / "a", placed["path"], r=8, seed=3, std=0.1)
    ids = _ids(placed["tok"], 24)
    outs = []
    for model in (placed["ref"], placed["model"]):
        lora = ExLlamaV2Lora.from_directory(model, str(adir))
        try:
            cache = _new_cache(placed, model, 256)
            steps = [model.forward(ids, cache, loras=[lora])[0].float().cpu()]
            for t in range(8):  # captured decode steps with the adapter
                steps.append(model.forward(ids[:, t:t + 1], cache, loras=[lora])[0].float().cpu())
            outs.append(torch.cat(steps))
        finally:
            lora.unload()
    assert rel_err(outs[1], outs[0]) < 1e-2


def test_openai_server_completion(placed: dict[str, Any]) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from exlpy.server import create_app, state_from_generator

    tok, m = placed["tok"], placed["model"]
    ids = tok.encode(PROMPTS[2], add_bos=True)
    gen = ExLlamaV2DynamicGenerator(m, _new_cache(placed, m, 2048), tok)
    gen.enqueue(ExLlamaV2DynamicJob(ids, 16, gen_settings=GREEDY, stop_conditions=[tok.eos_token_id]))
    want, count = "", 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            want += r.get("text", "")
            count += r["token_ids"].numel() if "token_ids" in r else 0
    with TestClient(create_app(state_from_generator(gen, "m"))) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": ids.view(-1).tolist(), "max_tokens": 16,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
    # The server runs the same generator on the same placed model: the same greedy text.
    assert body["usage"]["completion_tokens"] == count
    assert body["choices"][0]["text"] == want


def test_cross_device_uploads_alternate() -> None:
    """Round-robin metadata uploads to one GPU, then the other, then both in turn: every upload lands (the class
    of bug where a per-slot CUDA event created on one device was recorded on another's stream)."""
    from exlpy.model.batch import staging

    dsts = [torch.zeros(64, dtype=torch.int64, device=f"cuda:{i}") for i in (0, 1)]
    for k in range(40):
        dev = (k // 3) % 2 if k < 20 else k % 2
        staging.upload(list(range(k, k + 64)), dsts[dev])
        torch.cuda.synchronize(dev)
        assert dsts[dev].tolist() == list(range(k, k + 64))
    assert set(staging.rings) >= {0, 1}
    for idx, ring in staging.rings.items():
        assert ring.device == torch.device("cuda", idx)
