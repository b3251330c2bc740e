"""`exlpy eval ppl | speed`: exllamav2's test_inference.py workflows (spec §11), with its flag names.

    exlpy eval ppl -m MODEL -ed DATA.parquet [-er 128] [-el 2048] [-et] [-e8] [-eq4] [-eq6] [-eq8] [-sl]
    exlpy eval speed -m MODEL [-ps] [-s] [-l MAX_SEQ_LEN]

`ppl` prints the perplexity of one forward per row (with -sl: layer streaming, for models larger than GPU
memory: each module loaded once for all rows, two rows at a time), then, for each cache flag, the token-by-token
perplexity through that cache (every position reads the keys and values the cache stored). `speed` runs the
prefill sweep (-ps) and the decode sweep (-s). HumanEval and MMLU (exllamav2's eval/) run through lm-evaluation-harness
against `exlpy serve` (benchmarks/lm_eval_server.py; README "Evaluation").
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from exlpy.errors import ConfigError

CACHE_FLAGS = (("et", "fp16", "FP16"), ("e8", "fp8", "FP8"), ("eq4", "q4", "Q4"), ("eq6", "q6", "Q6"),
               ("eq8", "q8", "Q8"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="perplexity and speed tests (exllamav2's test_inference.py)",
                       description=__doc__.split("\n\n")[0])
    kinds = p.add_subparsers(dest="eval_kind", required=True)
    ppl = kinds.add_parser("ppl", help="perplexity over a dataset (.parquet, .txt or .jsonl)")
    _model_args(ppl)
    ppl.add_argument("-ed", "--eval_dataset", "--dataset", dest="dataset", required=True,
                     help="dataset: .parquet (every column of a row joined with spaces), .txt, or .jsonl lines of "
                     "{\"text\": ...} / {\"input_ids\": [...]}")
    ppl.add_argument("-er", "--eval_rows", "--rows", dest="rows", type=int, default=128, help="rows (default 128)")
    ppl.add_argument("-el", "--eval_length", "--length", dest="length", type=int, default=2048,
                     help="tokens per row (default 2048)")
    for flag, _, name in CACHE_FLAGS:
        ppl.add_argument(f"-{flag}", dest=flag, action="store_true",
                         help=f"also token-by-token perplexity with the {name} cache")
    ppl.add_argument("-sl", "--stream_layers", action="store_true",
                     help="layer streaming: load each module just before it runs (models larger than GPU memory); "
                     "every row through one module before the next, 2 rows at a time")
    ppl.set_defaults(_run=run_ppl)
    speed = kinds.add_parser("speed", help="prefill (-ps) and decode (-s) speed sweeps")
    _model_args(speed)
    speed.add_argument("-ps", "--prompt_speed", action="store_true", help="prefill speed: random prompts of "
                       "128, 256, ... tokens up to max_seq_len, best of 3 runs each")
    speed.add_argument("-s", "--speed", action="store_true", help="decode speed: greedy from \"X\" to max_seq_len, "
                       "tokens/s per 128 positions")
    speed.set_defaults(_run=run_speed)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model_dir", "--model", dest="model", required=True, help="model directory")
    p.add_argument("-l", "--max_seq_len", dest="max_seq_len", type=int, default=None,
                   help="model max_seq_len (default: the model's)")
    p.add_argument("-gs", "--gpu_split", default=None, help="GB per GPU, comma-separated (default: autosplit)")


def _load(args: argparse.Namespace, need_len: int, lazy: bool = False) -> tuple[Any, Any]:
    from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer

    config = ExLlamaV2Config(args.model)
    if args.max_seq_len:
        config.max_seq_len = args.max_seq_len
    if need_len > config.max_seq_len:
        config.max_seq_len = need_len
    model = ExLlamaV2(config)
    t0 = time.perf_counter()
    if args.gpu_split:
        model.load(gpu_split=[float(x) for x in args.gpu_split.split(",")], lazy=lazy)
    else:
        model.load(lazy=lazy)
    print(f" -- Model: {args.model} (loaded in {time.perf_counter() - t0:.1f} s)")
    return model, ExLlamaV2Tokenizer(config)


def run_ppl(args: argparse.Namespace) -> int:
    from exlpy.eval import dataset_rows, perplexity, perplexity_streamed, perplexity_token_by_token

    if args.rows < 1 or args.length < 2:
        raise ConfigError("-er must be >= 1 and -el >= 2")
    if args.stream_layers and any(getattr(args, flag) for flag, _, _ in CACHE_FLAGS):
        raise ConfigError("-sl (layer streaming) scores whole rows layer by layer; it does not combine with the "
                          "token-by-token cache flags (-et/-e8/-eq4/-eq6/-eq8)")
    model, tok = _load(args, args.length, lazy=args.stream_layers)
    # (exllamav2 prepends BOS only for architectures that need it; none of exlpy's Llama-family ones does)
    ids = dataset_rows(args.dataset, tok, args.rows, args.length)
    print(f" -- Dataset: {args.dataset}, {args.rows} rows of {args.length} tokens")
    t0 = time.perf_counter()
    r = perplexity_streamed(model, ids) if args.stream_layers else perplexity(model, ids)
    what = "Evaluation perplexity (streamed)" if args.stream_layers else "Evaluation perplexity"
    print(f" -- {what}: {r.perplexity:.4f}  ({r.tokens} tokens, {time.perf_counter() - t0:.1f} s)")
    for flag, kind, name in CACHE_FLAGS:
        if getattr(args, flag):
            t0 = time.perf_counter()
            r = perplexity_token_by_token(model, ids, kind)
            print(f" -- Evaluation perplexity, token by token, {name} cache: {r.perplexity:.4f}  "
                  f"({time.perf_counter() - t0:.1f} s)")
    return 0


def run_speed(args: argparse.Namespace) -> int:
    from exlpy.eval import decode_speed, prefill_speed

    if not (args.prompt_speed or args.speed):
        raise ConfigError("give -ps (prefill speed) and/or -s (decode speed)")
    model, tok = _load(args, 0)
    max_len = model.config.max_seq_len
    if args.prompt_speed:
        print(" -- Measuring prompt speed...")
        for n, tps in prefill_speed(model, max_len):
            print(f" ** Length {n:>6} tokens: {tps:>10.1f} t/s")
    if args.speed:
        print(" -- Measuring token speed...")
        for a, b, tps in decode_speed(model, tok, max_len):
            print(f" ** Position {a:>5} - {b:>5}: {tps:>8.1f} t/s")
    return 0
