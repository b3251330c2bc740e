"""Speculative decoding speed on one GPU, in one run, next to plain decoding.

    PYTHONPATH=. python benchmarks/speculative.py --out benchmarks/results/speculative.md
    PYTHONPATH=. python benchmarks/speculative.py --quick --out /tmp/spec_quick.md

Part `replay`: a Llama-3-8B-shape target (random fp16 weights) with a Llama-3.2-1B-shape draft. Random weights
agree on nothing, so the draft is a replay draft: it runs its real forward passes (their cost is what is
measured), but proposes the target's own greedy token with probability a, and another token otherwise. The
target's greedy tokens come from a plain run first. Tokens/s at acceptance a = 0.5 / 0.7 / 0.8 / 0.9 and batch 1,
4, 16, against plain decoding of the same jobs (512-token prompts, 256 new tokens, the dynamic generator, draft
length adapted). Target: >= 1.8x plain at batch 1 and a = 0.8.

Part `ngram`: the real SmolLM2-135M-Instruct (EXL2 4.0, `--smol`, default /tmp/smol, else ../shared) asked to
repeat, and to lightly edit, a 1,000-token passage (`--passage`, default ../shared/eval/licenses.txt); n-gram
drafting from the prompt vs plain greedy decoding at batch 1. Reports acceptance, speedup and whether the text
is identical. Target: >= 1.5x.

Results: a markdown file with device, date and command.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import model_dir  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"


def drive(gen: Any, jobs: list[Any]) -> tuple[float, dict[Any, list[int]]]:
    """Iterate enqueued jobs to the end; (steady tokens/s after every job's first token, tokens per job)."""
    out: dict[Any, list[int]] = {j: [] for j in jobs}
    t_all, after = None, 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["stage"] != "streaming":
                continue
            toks = r["token_ids"][0].tolist()
            first = not out[r["job"]]
            out[r["job"]] += toks
            if t_all is None and all(out[j] for j in jobs):
                t_all = time.perf_counter()
                continue
            if t_all is not None and not first:
                after += len(toks)
    t_end = time.perf_counter()
    return (after / (t_end - t_all) if t_all and t_end > t_all else float("nan")), out


class ReplayDrafter:
    """Wraps the generator's ModelDrafter: the draft model runs for real, its proposals are replaced by the
    target's greedy continuation (probability `rate`) or another token."""

    def __init__(self, inner: Any, refs: dict[int, list[int]], rate: float, vocab: int, seed: int = 0) -> None:
        self.inner, self.refs, self.rate, self.vocab = inner, refs, rate, vocab
        self.rng = random.Random(seed)
        self.cache = inner.cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, seqs: list[Any], k: int, target_device: torch.device) -> torch.Tensor:
        own = self.inner.propose(seqs, k, target_device)  # the draft model's cost
        rows = []
        for q in seqs:
            ref = self.refs.get(id(q))
            L = q.ids.numel()
            aligned = ref is not None and q.ids.tolist() == ref[:L]  # else the output left the reference
            row = []
            for i in range(k):
                want = ref[L + i] if aligned and L + i < len(ref) else None
                if want is not None and self.rng.random() < self.rate:
                    row.append(want)
                else:
                    t = self.rng.randrange(3, self.vocab)
                    row.append(t if t != want else (t + 1) % self.vocab)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long).to(own.device, non_blocking=True)


def part_replay(work: str, batches: list[int], rates: list[float], new_tokens: int) -> list[str]:
    from exlpy import ExLlamaV2Cache, ExLlamaV2Tokenizer
    from exlpy.cli.bench import load_model
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    prompt_len = 512
    target = load_model(model_dir(work, "8b"), prompt_len + new_tokens + 16, max(batches))
    draft = load_model(model_dir(work, "1b"), prompt_len + new_tokens + 16, max(batches))
    tok = ExLlamaV2Tokenizer(target.config)
    vocab = target.config.vocab_size
    greedy = ExLlamaV2Sampler.Settings.greedy()
    lines = ["## (a) 8B target, 1B replay draft (random fp16 weights)", "",
             f"{prompt_len}-token prompts, {new_tokens} new tokens per job, greedy, draft length adapted "
             "(chosen per round from the measured acceptance). Plain = the same generator without a draft.", "",
             "| batch | plain tok/s | " + " | ".join(f"a={a} tok/s (x plain, measured acceptance, draft length)"
                                                   for a in rates) + " |",
             "|---|---|" + "---|" * len(rates)]
    for b in batches:
        pages = -(-(prompt_len + new_tokens + 8) // 256)
        rng = torch.Generator().manual_seed(b)
        prompts = [torch.randint(3, vocab, (1, prompt_len), generator=rng) for _ in range(b)]

        def jobs(n: int, prompts: list[torch.Tensor] = prompts) -> list[Any]:
            return [ExLlamaV2DynamicJob(p, n, gen_settings=greedy, stop_conditions=[]) for p in prompts]

        cache = ExLlamaV2Cache(target, max_seq_len=b * pages * 256)
        plain = ExLlamaV2DynamicGenerator(target, cache, tok, max_batch_size=b)
        for n in (8, new_tokens):  # the first run captures the graphs
            plain.enqueue(js := jobs(n))
            base, ref_out = drive(plain, js)
        refs = [p[0].tolist() + ref_out[j] for p, j in zip(prompts, js)]
        del plain
        cells = []
        dcache = ExLlamaV2Cache(draft, max_seq_len=b * pages * 256)
        gen = ExLlamaV2DynamicGenerator(target, cache, tok, max_batch_size=b, draft_model=draft, draft_cache=dcache)
        replay = ReplayDrafter(gen.spec.drafter, {}, 0.0, vocab)
        gen.spec.drafter = replay
        for a in rates:
            replay.rate = a
            for n in (64, new_tokens):  # warm-up (graphs of the draft lengths it picks), then the timed run
                gen.enqueue(js := jobs(n))
                replay.refs = {id(j.seqs[0]): r for j, r in zip(js, refs)}
                gen.reset_sd_stats()
                speed, _ = drive(gen, js)
            acc = gen.get_sd_stats()[1]
            cells.append(f"{speed:,.1f} ({speed / base:.2f}x, {acc:.2f}, {gen.spec.length.choose()})")
            print(f"batch {b} a={a}: {cells[-1]} vs plain {base:,.1f}", flush=True)
        lines.append(f"| {b} | {base:,.1f} | " + " | ".join(cells) + " |")
        del gen, cache, dcache
        gc.collect()
        torch.cuda.empty_cache()
    target.unload()
    draft.unload()
    return lines + [""]


def passage_text(tok: Any, path: str, n_tokens: int) -> str:
    text = Path(path).read_text(encoding="utf-8")
    ids = tok.encode(text[: n_tokens * 8])[0][:n_tokens]
    return tok.decode(ids)


def part_ngram(smol: str, passage_file: str, passage_tokens: int) -> list[str]:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

    config = ExLlamaV2Config(smol)
    config.max_seq_len = 4096
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=4096, lazy=True)
    model.load_autosplit(cache)
    tok = ExLlamaV2Tokenizer(config)
    passage = passage_text(tok, passage_file, passage_tokens)
    tasks = {"repeat": f"Repeat the following text exactly, word for word:\n\n{passage}",
             "light edit": "Copy the following text, but write the word \"Software\" in capital letters (SOFTWARE) "
                           f"every time it appears. Change nothing else:\n\n{passage}"}
    greedy = ExLlamaV2Sampler.Settings.greedy()
    lines = ["## (b) n-gram drafting, real SmolLM2-135M-Instruct EXL2 4.0, batch 1", "",
             f"`{smol}`; a {passage_tokens}-token passage of `{passage_file}` in the prompt; greedy; up to "
             f"{passage_tokens + 100} new tokens. Plain = the same generator without drafting.", "",
             "| task | tokens | plain tok/s | n-gram tok/s | speedup | acceptance | draft length | same text |",
             "|---|---|---|---|---|---|---|---|"]
    for task, instruction in tasks.items():
        text = tok.apply_chat_template([{"role": "user", "content": instruction}], add_generation_prompt=True)
        ids = tok.encode(text, add_bos=False, encode_special_tokens=True)
        runs = {}
        for name, kw in (("plain", {}), ("ngram", {"use_ngram_draft": True})):
            gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_batch_size=1, **kw)
            for n in (16, passage_tokens + 100):  # warm-up (graphs), then the timed run
                gen.enqueue(js := [ExLlamaV2DynamicJob(ids, n, gen_settings=greedy)])
                gen.reset_sd_stats()
                speed, out = drive(gen, js)
            runs[name] = (speed, out[js[0]], gen.get_sd_stats()[1], gen.spec.length.choose() if gen.spec else 0)
        (ps, pt, _, _), (ns, nt, acc, k) = runs["plain"], runs["ngram"]
        target = "met" if ns >= 1.5 * ps else "**missed**"
        lines.append(f"| {task} | {len(nt)} | {ps:,.1f} | {ns:,.1f} | {ns / ps:.2f}x (target >= 1.5x: {target}) | "
                     f"{acc:.2f} | {k} | {'yes' if nt == pt else 'no'} |")
        print(lines[-1], flush=True)
    model.unload()
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="markdown results file")
    ap.add_argument("--parts", default="replay,ngram", help="comma list of: replay, ngram")
    ap.add_argument("--work", default="/tmp/exlpy_bench", help="where the random-weight models are written")
    ap.add_argument("--smol", default=None, help="SmolLM2-135M EXL2 dir (default: /tmp/smol, else ../shared)")
    ap.add_argument("--passage", default=str(SHARED / "eval" / "licenses.txt"), help="text file for part ngram")
    ap.add_argument("--quick", action="store_true", help="batch 1, acceptance 0.8, shorter runs")
    ap.add_argument("--append", action="store_true", help="add to --out instead of replacing it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/speculative.py needs a CUDA device")
    smol = args.smol or next((d for d in ("/tmp/smol", str(SHARED / "models" / "smollm2-135m-exl2-4.0"))
                              if os.path.isdir(d)), "/tmp/smol")
    header = ["# Speculative decoding vs plain decoding", "",
              f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
              f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
              f"- command: `python {' '.join(sys.argv)}`", ""]
    body: list[str] = []
    if args.append and Path(args.out).exists():
        header = [Path(args.out).read_text().rstrip(), "", f"### Appended: `python {' '.join(sys.argv)}`", ""]
    parts = args.parts.split(",")
    if "replay" in parts:
        batches, rates, n = ([1], [0.8], 64) if args.quick else ([1, 4, 16], [0.5, 0.7, 0.8, 0.9], 256)
        body += part_replay(args.work, batches, rates, n)
        Path(args.out).write_text("\n".join(header + body) + "\n")
    if "ngram" in parts:
        body += part_ngram(smol, args.passage, 300 if args.quick else 1000)
    text = "\n".join(header + body) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
