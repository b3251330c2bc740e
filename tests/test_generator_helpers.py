"""Helpers shared by the generator tests (no tests here): the aidreams260K model, an argmax oracle, and a long
prompt prefilled next to decoding jobs."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from tests.conftest import shared_path

PROMPTS = ["Echoes of", "Once", "The gentle hum of", "A", "Vectors align, and", "In the quiet", "Precision", "Why"]


@lru_cache(maxsize=2)
def _load(path: str, device: str | None = None) -> tuple[Any, Any]:
    from exlpy import ExLlamaV2, ExLlamaV2Config
    from exlpy.tokenizer import ExLlamaV2Tokenizer

    cfg = ExLlamaV2Config(path)
    cfg.max_seq_len = 2048  # trained for 128 positions; the paged tests need longer RoPE tables
    model = ExLlamaV2(cfg)
    if device is None:
        model.load()
    else:
        model.load(device=device)
    return model, ExLlamaV2Tokenizer(cfg)


def aidreams() -> tuple[Any, Any]:
    """(model, tokenizer), loaded once per test session."""
    return _load(str(shared_path("models", "aidreams260K")))


def aidreams_cpu() -> tuple[Any, Any]:
    """The same model on the CPU in fp32, for tests that compare seeded sampling token for token with a
    full-forward oracle: on a GPU (fp16) the incremental step's logits differ from a full forward in the last
    bits, which moves a top-p draw across a candidate boundary now and then."""
    return _load(str(shared_path("models", "aidreams260K")), "cpu")


def argmax_tokens(model: Any, ids: torch.Tensor, n: int) -> list[int]:
    """The oracle: n greedy tokens from full forward passes without any cache."""
    out: list[int] = []
    seq = ids.clone()
    for _ in range(n):
        t = int(model.forward(seq)[0, -1].argmax())
        out.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return out


def drain(gen: Any) -> dict[Any, dict[str, Any]]:
    """Run a dynamic generator until idle; per job: concatenated text, token ids and the final result."""
    acc: dict[Any, dict[str, Any]] = {}
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            a = acc.setdefault(r["job"], {"text": "", "tokens": [], "final": None, "stages": []})
            a["stages"].append(r["stage"])
            if r["stage"] == "streaming":
                a["text"] += r["text"]
                a["tokens"] += r["token_ids"][0].tolist()
                if r["eos"]:
                    a["final"] = r
    return acc


def decode_next_to_long_prompt(gen: Any, prompt_len: int, decode_len: int, new_tokens: int) -> tuple[Any, list[int]]:
    """Three jobs decoding (`decode_len` tokens each), then a random prompt of `prompt_len` tokens (asking
    `new_tokens`) enqueued beside them and iterated until it has its first token: its admission, every prompt chunk
    and the steps where it joins the decode batch (one more row; its first token one iteration later, the steps
    overlapping). Every decoding job must get a token in every one of those iterations, in that iteration's results:
    a skipped or held-back iteration doubles every stream's gap. Returns (the long job, the prompt tokens each
    iteration prefilled)."""
    from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    greedy = ExLlamaV2Sampler.Settings.greedy()
    decoders = [ExLlamaV2DynamicJob(torch.tensor([[1, 7 + k, 9]]), decode_len, gen_settings=greedy,
                                    stop_conditions=[]) for k in range(3)]
    gen.enqueue(decoders)
    while not all(j.new_tokens for j in decoders):
        gen.iterate()
    long = ExLlamaV2DynamicJob(torch.randint(3, 500, (1, prompt_len), generator=torch.Generator().manual_seed(3)),
                               new_tokens, gen_settings=greedy, stop_conditions=[])
    gen.enqueue(long)
    chunks: list[int] = []
    states: list[str] = []
    while not long.new_tokens:
        before = {j: j.new_tokens for j in decoders}
        p0 = gen.prefill_tokens
        states.append("prefill" if not long.is_prefilled() else "joining")
        results = gen.iterate()
        if states[-1] == "prefill":
            chunks.append(gen.prefill_tokens - p0)
        shown = {j: 0 for j in decoders}
        for r in results:
            if r["stage"] == "streaming" and r["job"] in shown:
                shown[r["job"]] += r["token_ids"].shape[-1]
        late = [j.serial for j in decoders if (j.new_tokens != before[j] + 1 or shown[j] != 1) and not j.finished]
        assert not late, f"iteration {len(states) - 1} ({states[-1]}): jobs {late} got no token in the results"
    # its last chunk's iteration launches its first decode step (one more row); the next one reads that token
    assert states.count("joining") == 1
    return long, chunks
