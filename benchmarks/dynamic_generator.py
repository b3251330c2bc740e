"""Dynamic generator throughput: N concurrent jobs (default 32) through continuous batching on one GPU.

    PYTHONPATH=. python benchmarks/dynamic_generator.py --out dyn.md                  # random fp16 SmolLM2-135M shape
    PYTHONPATH=. python benchmarks/dynamic_generator.py --model DIR --out dyn.md      # e.g. the SmolLM2 EXL2 dir

Without --model a random-weight fp16 model with SmolLM2-135M's shape (and a synthetic word-level tokenizer) is
written to a temporary directory first, so the script needs nothing but this repository. Prompts are random
token ids; every job runs to max_new_tokens (no stop conditions), so the numbers measure the generator and the
model, not the text. Results: a markdown table (per-job and total tokens/s) written to --out and printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def build_random_model(path: Path, device: str) -> None:
    """Write config.json, random fp16 safetensors and a synthetic tokenizer.json for a SmolLM2-135M shape."""
    from safetensors.torch import save_file

    c = SMOLLM2_135M
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "torch_dtype": "float16", "head_dim": c["hidden_size"] // c["num_attention_heads"], **c}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator(device=device).manual_seed(0)
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = cfg["head_dim"]
    kv = c["num_key_value_heads"] * d

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).half().cpu()

    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        t[p + "self_attn.q_proj.weight"] = rnd(c["num_attention_heads"] * d, h)
        t[p + "self_attn.k_proj.weight"] = rnd(kv, h)
        t[p + "self_attn.v_proj.weight"] = rnd(kv, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, c["num_attention_heads"] * d)
        t[p + "mlp.gate_proj.weight"] = rnd(i, h)
        t[p + "mlp.up_proj.weight"] = rnd(i, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, i)
    save_file(t, str(path / "model.safetensors"))
    write_word_tokenizer(path, v)


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A synthetic tokenizer.json (+ config) for random-weight models: byte-level BPE over the 256 byte symbols
    plus filler word pieces up to `vocab_size`, so any text encodes and every id decodes (ids 0-2: unk, BOS, EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + k for k, ch in enumerate(alphabet)}}
    vocab.update({f"\u0120w{k}": k for k in range(len(vocab), vocab_size)})
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def run(model_dir: str, jobs: int, prompt_len: int, new_tokens: int, seed: int) -> tuple[list[dict], float, dict]:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exlpy.tokenizer import ExLlamaV2Tokenizer

    cfg = ExLlamaV2Config(model_dir)
    model = ExLlamaV2(cfg)
    pages_per_job = -(-(prompt_len + new_tokens) // 256)
    cache = ExLlamaV2Cache(model, max_seq_len=jobs * pages_per_job * 256, lazy=True)
    model.load_autosplit(cache)
    tok = ExLlamaV2Tokenizer(cfg)
    gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_batch_size=jobs)
    gen.warmup()
    vocab = min(cfg.vocab_size, len(tok.get_id_to_piece_list()))
    rng = torch.Generator().manual_seed(seed)
    settings = ExLlamaV2Sampler.Settings.greedy()
    batch = [ExLlamaV2DynamicJob(torch.randint(3, vocab, (1, prompt_len), generator=rng), new_tokens,
                                 gen_settings=settings, stop_conditions=[], identifier=k) for k in range(jobs)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen.enqueue(batch)
    finals: list[dict] = []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["eos"]:
                finals.append(r)
    wall = time.perf_counter() - t0
    stats = {"prefill_tokens": gen.prefill_tokens, "decode_tokens": gen.decode_tokens,
             "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    return finals, wall, stats


def table(finals: list[dict], wall: float, stats: dict, args: argparse.Namespace, label: str) -> str:
    per_job = [r["new_tokens"] / max(r["time_generate"], 1e-9) for r in finals]
    ttft = [r["time_enqueued"] + r["time_prefill"] for r in finals]
    total = sum(r["new_tokens"] for r in finals)
    errors = [r for r in finals if r.get("eos_reason") == "error"]
    lines = [f"## Dynamic generator: {args.jobs} concurrent jobs, {label}", "",
             f"device: {stats['device']}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per job, "
             f"greedy; prefill tokens run {stats['prefill_tokens']}, decode tokens {stats['decode_tokens']}"
             + (f"; **{len(errors)} jobs failed**" if errors else ""), "",
             "| metric | value |", "|---|---|",
             f"| total throughput (new tokens / wall) | {total / wall:.1f} tok/s |",
             f"| per-job decode speed, mean | {statistics.mean(per_job):.1f} tok/s |",
             f"| per-job decode speed, min / max | {min(per_job):.1f} / {max(per_job):.1f} tok/s |",
             f"| time to first token, mean / max | {statistics.mean(ttft) * 1e3:.0f} / {max(ttft) * 1e3:.0f} ms |",
             f"| wall time | {wall:.2f} s |", f"| new tokens | {total} |", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build a random fp16 SmolLM2-135M-shaped one)")
    ap.add_argument("--out", required=True, help="markdown file to write the results table to")
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.model:
        finals, wall, stats = run(args.model, args.jobs, args.prompt_len, args.new_tokens, args.seed)
        label = f"model `{args.model}`"
    else:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        with tempfile.TemporaryDirectory() as d:
            build_random_model(Path(d), dev)
            finals, wall, stats = run(d, args.jobs, args.prompt_len, args.new_tokens, args.seed)
        label = "random-weight fp16 SmolLM2-135M shape"
    md = table(finals, wall, stats, args, label)
    Path(args.out).write_text(md)
    print(md)


if __name__ == "__main__":
    main()
