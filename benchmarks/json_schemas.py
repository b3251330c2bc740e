"""JSON-schema constrained output from a real model: 50 different schemas, every output must parse and validate.

Each case asks the model (through its chat template) for a JSON object in words, with the schema in the
prompt, and constrains decoding with `ExLlamaV2GrammarFilter.json_schema`. All jobs run at once in the dynamic
generator, greedy. The output is parsed with `json.loads` and checked with `jsonschema.validate`.

    python -m benchmarks.json_schemas [--model DIR] [--quick] [--out benchmarks/results/json_schemas.md]

Runs on the CPU (SmolLM2-135M EXL2 by default) or a GPU. Needs `pip install -e '.[grammar,test]'`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.json_schema_cases import CASES

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "smollm2-135m-exl2-4.0"
MAX_NEW_TOKENS = 256


def prompt_for(tokenizer: Any, what: str, schema: dict[str, Any]) -> torch.Tensor:
    messages = [{"role": "user", "content": f"Give me {what} as a JSON object following this JSON schema:\n"
                                            f"{json.dumps(schema)}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, encode_special_tokens=True)


def run_cases(generator: Any, cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Generate for every case at once; per case: text, parsed value or error, token count."""
    import jsonschema

    from exlpy.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exlpy.generator.filters import ExLlamaV2GrammarFilter

    model, tok = generator.model, generator.tokenizer
    jobs = []
    for k, (what, schema) in enumerate(cases):
        f = ExLlamaV2GrammarFilter.json_schema(model, tok, schema)
        jobs.append(ExLlamaV2DynamicJob(prompt_for(tok, what, schema), MAX_NEW_TOKENS, identifier=k, filters=[f],
                                        gen_settings=ExLlamaV2Sampler.Settings.greedy()))
    generator.enqueue(jobs)
    out: list[dict[str, Any]] = [{"text": "", "tokens": 0} for _ in cases]
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["stage"] != "streaming":
                continue
            o = out[r["identifier"]]
            o["text"] += r["text"]
            if r["eos"]:
                o["tokens"] = r["new_tokens"]
                o["reason"] = r.get("eos_reason")
                if "error" in r:
                    raise r["error"]
    for o, (_, schema) in zip(out, cases):
        try:
            o["value"] = json.loads(o["text"])
            jsonschema.validate(o["value"], schema)
            o["valid"] = True
        except (ValueError, jsonschema.ValidationError) as err:
            o["valid"], o["error"] = False, str(err).splitlines()[0]
    return out


def load(model_dir: str) -> Any:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.generator import ExLlamaV2DynamicGenerator

    cfg = ExLlamaV2Config(model_dir)
    cfg.max_seq_len = min(cfg.max_seq_len, 2048)
    model = ExLlamaV2(cfg)
    cache = ExLlamaV2Cache(model, max_seq_len=64 * 1024, lazy=True)
    model.load_autosplit(cache)
    return ExLlamaV2DynamicGenerator(model, cache, ExLlamaV2Tokenizer(cfg), max_batch_size=64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--quick", action="store_true", help="the first 10 schemas")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "json_schemas.md"))
    args = ap.parse_args()
    cases = CASES[:10] if args.quick else CASES
    gen = load(args.model)
    t0 = time.perf_counter()
    results = run_cases(gen, cases)
    dt = time.perf_counter() - t0
    valid = sum(r["valid"] for r in results)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    lines = [f"# JSON-schema constrained output: {valid}/{len(cases)} valid", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- device: {device}, torch {torch.__version__}", f"- model: `{args.model}`",
             f"- command: `python -m benchmarks.json_schemas{' --quick' if args.quick else ''}`",
             f"- {len(cases)} jobs at once in the dynamic generator, greedy, max {MAX_NEW_TOKENS} new tokens; "
             f"{sum(r['tokens'] for r in results)} tokens in {dt:.1f} s", "",
             "| # | request | tokens | valid | output |", "|---|---|---|---|---|"]
    for k, ((what, _), r) in enumerate(zip(cases, results)):
        shown = r["text"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {k} | {what} | {r['tokens']} | {'yes' if r['valid'] else 'NO: ' + r['error']} | "
                     f"`{shown[:120]}` |")
    report = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report)
    return 0 if valid == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
