"""Speculative decoding speed on one GPU, in one run, next to plain decoding.

    PYTHONPATH=. python benchmarks/speculative.py --out benchmarks/results/speculative.md
    PYTHONPATH=. python benchmarks/speculative.py --quick --out /tmp/spec_quick.md

    PYTHONPATH=. python benchmarks/speculative.py --parts replay --batches 1 --rates 0.5,0.8,1.0 --out /tmp/s.md

Part `replay`: a Llama-3-8B-shape target (random fp16 weights) with a Llama-3.2-1B-shape draft. Random weights
agree on nothing, so the draft is a replay draft: it runs its real forward passes (their cost is what is
measured), but each draft is the target's own greedy token with probability a, another token otherwise (the
greedy token is read from the verification step: see `ReplayDrafter`). Tokens/s at acceptance a = 0.5 / 0.7 /
0.8 / 0.9 and batch 1, 4, 16 (`--rates`, `--batches`), against plain decoding of the same jobs (512-token
prompts, 256 new tokens, the dynamic generator, draft length adapted; `--ahead both` times each rate with and
without rounds launched ahead of the previous round's bookkeeping). Target: >= 1.8x plain at batch 1 and
a = 0.8.

Part `ngram`: the real SmolLM2-135M-Instruct (fp16 from `--smollm2 DIR`, the directory that
../shared/tools/smollm2_fp16.py builds; else EXL2 4.0, `--smol`, default /tmp/smol, else ../shared) asked to
repeat, to lightly edit and to summarise quoting a 1,000-token passage (`--passage`, default
../shared/eval/licenses.txt, else this repository's README.md), and to rename a variable in a Python file of this
repository; n-gram drafting from the prompt vs plain greedy decoding at batch 1. Reports per-token acceptance,
mean draft length, speedup, whether the text is identical, and each run's mean round (`RoundProfile`).
Target: >= 1.5x.

Part `ngram8b`: n-gram drafting on the 8B shape (random fp16 weights) whose greedy text is scripted to repetitive
workloads (benchmarks/ngram_workloads.py: a code edit, a summary quoting its input, and shuffled words where
acceptance is low), batch 1, vs plain decoding under the same script. Targets: >= 1.5x on the repetitive ones,
never below 0.97x.

Results: a markdown file with device, date and command.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


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
    """Wraps the generator's ModelDrafter: the draft model runs its real forward passes (their cost is what is
    measured), and each of its k drafts is then made the target's own greedy token with probability `rate`,
    another token otherwise, so that the target accepts a draft with probability `rate` once the drafts before
    it were accepted.

    The target's greedy tokens are taken from the verification step itself (`patched()` puts `verify` in
    front of the library's verification), not from a plain run done first: with random fp16 weights the two
    part within some dozens of tokens. The top two logits often tie or nearly (a small random fp16 model on
    the CPU: 5% of steps within 0.01, an exact tie by token 94), and a verification step of k+1 tokens rounds
    differently from a decode step of one, so an argmax flips; from there on a reference from plain decoding
    predicts nothing and every draft is rejected (the first replay draft: measured acceptance 0.15-0.35 at
    a = 0.5-0.9 on an H100, draft length stuck at 1). Swapping drafts after
    the target step leaves every cost as it was (the same steps, shapes and one read-back per round); the text
    is no longer the target's greedy text, which random weights do not have anyway."""

    def __init__(self, inner: Any, rate: float, vocab: int, seed: int = 0) -> None:
        self.inner, self.rate, self.vocab = inner, rate, vocab
        self.rng = random.Random(seed)
        self.cache = inner.cache
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (drafts, their replay plan)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, seqs: list[Any], k: int, target_device: torch.device) -> torch.Tensor:
        from exlpy.model.batch import upload_ids

        own = self.inner.propose(seqs, k, target_device)  # the draft model's cost
        # Per draft: 0 = the target's greedy token, else an offset from it (never the greedy token itself).
        plan = [0 if self.rng.random() < self.rate else self.rng.randrange(1, self.vocab)
                for _ in range(len(seqs) * k)]
        self.pending = (own, upload_ids(torch.tensor(plan, dtype=torch.long).view(len(seqs), k), own.device))
        return own

    def verify(self, original: Any, logits: torch.Tensor, drafts: torch.Tensor, *args: Any) -> Any:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] is drafts:
            k = drafts.shape[1]
            # The target's token after the last token and after each draft (the tokenizer's vocabulary: the
            # verification masks the model's padding columns), then the replay's choice; on the device, no sync.
            greedy = logits[:, :k, :self.vocab].argmax(-1)
            drafts.copy_(torch.remainder(greedy + pending[1], self.vocab))
        return original(logits, drafts, *args)

    @contextmanager
    def patched(self) -> Iterator[None]:
        """Both verification paths: the host's `verify_rows` and the captured sampler's (a GPU's default)."""
        from exlpy.generator.sampling.graphed import GraphSampler
        from exlpy.generator.speculative import dynamic

        original = dynamic.verify_rows
        captured = GraphSampler.verify
        dynamic.verify_rows = lambda *a: self.verify(original, *a)

        def verify_captured(sampler: Any, logits: torch.Tensor, drafts: torch.Tensor, *a: Any) -> Any:
            return self.verify(lambda *b: captured(sampler, *b), logits, drafts, *a)

        GraphSampler.verify = verify_captured  # type: ignore[method-assign]
        try:
            yield
        finally:
            dynamic.verify_rows = original
            GraphSampler.verify = captured  # type: ignore[method-assign]


def spec_figures(gen: Any) -> tuple[float, float, float]:
    """(per-token acceptance, accepted / drafted, mean draft length) since the last reset_sd_stats()."""
    s = gen.spec
    return s.acceptance_per_token(), gen.get_sd_stats()[1], s.mean_draft_length()


def part_replay(work: str, batches: list[int], rates: list[float], new_tokens: int,
                progress: Any = None, ahead: tuple[bool, ...] = (True,)) -> list[str]:
    """The table's lines; `progress(lines)` is called after each batch size (a run cut short keeps those).
    `ahead`: with rounds launched ahead of the bookkeeping (`Speculation.chain`, the default) and/or without,
    each timed on the same loaded models (a column per rate and mode)."""
    from exlpy import ExLlamaV2Cache, ExLlamaV2Tokenizer
    from exlpy.cli.bench import load_model
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exlpy.generator.speculative.profile import RoundProfile

    prompt_len = 512
    target = load_model(model_dir(work, "8b"), prompt_len + new_tokens + 16, max(batches))
    draft = load_model(model_dir(work, "1b"), prompt_len + new_tokens + 16, max(batches))
    tok = ExLlamaV2Tokenizer(target.config)
    vocab = target.config.vocab_size
    greedy = ExLlamaV2Sampler.Settings.greedy()
    lines = ["## (a) 8B target, 1B replay draft (random fp16 weights)", "",
             f"{prompt_len}-token prompts, {new_tokens} new tokens per job, greedy, draft length adapted "
             "(chosen per round from the measured acceptance and the measured cost of a draft step). Plain = the "
             "same generator without a draft. Acceptance: per token, accepted / (accepted + rejections), which "
             "estimates a (accepted / drafted, exllamav2's figure, is lower by construction when k > 1); k: mean "
             "draft length of the timed run; c: the measured cost of a draft step relative to the rest of a round.",
             "",
             "| batch | plain tok/s | " + " | ".join(f"a={a}{_mode(m, ahead)} tok/s (x plain, acceptance, k, c)"
                                                  for a in rates for m in ahead) + " |",
             "|---|---|" + "---|" * (len(rates) * len(ahead))]
    breakdown: list[str] = []
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
            base, _ = drive(plain, js)
        del plain
        cells = []
        dcache = ExLlamaV2Cache(draft, max_seq_len=b * pages * 256)
        gen = ExLlamaV2DynamicGenerator(target, cache, tok, max_batch_size=b, draft_model=draft, draft_cache=dcache)
        assert gen.spec is not None
        replay = ReplayDrafter(gen.spec.drafter, 1.0, len(gen.pieces))
        gen.spec.drafter = replay
        length = gen.spec.length
        with replay.patched():
            for k in range(1, length.max_k + 1):  # capture the verification graph of every draft length
                length.fixed = k
                gen.enqueue(js := jobs(2 * (k + 1)))
                drive(gen, js)
            length.fixed = None
            for a in rates:
                replay.rate = a
                for mode in ahead:
                    gen.spec.chain = mode
                    for n in (32, new_tokens):  # warm-up (the acceptance estimate settles), then the timed run
                        gen.enqueue(js := jobs(n))
                        gen.reset_sd_stats()
                        gen.spec.profile = RoundProfile() if n == new_tokens else None
                        speed, _ = drive(gen, js)
                    acc, _, k_mean = spec_figures(gen)
                    cells.append(f"{speed:,.1f} ({speed / base:.2f}x, {acc:.2f}, {k_mean:.1f}, "
                                 f"{length.step_cost:.2f})")
                    label = f"batch {b} a={a}{_mode(mode, ahead)}"
                    print(f"{label}: {cells[-1]} vs plain {base:,.1f}", flush=True)
                    breakdown.append(f"- {label}, verification {verify_path(gen)}: "
                                     + round_breakdown(gen.spec.profile, 1000.0 * b / base))
                    print(breakdown[-1], flush=True)
                    gen.spec.profile = None
            gen.spec.chain = True
        lines.append(f"| {b} | {base:,.1f} | " + " | ".join(cells) + " |")
        if progress is not None:
            progress(lines + [""] + breakdown_lines(breakdown))
        del gen, cache, dcache
        gc.collect()
        torch.cuda.empty_cache()
    target.unload()
    draft.unload()
    return lines + [""] + breakdown_lines(breakdown)


def _mode(ahead: bool, modes: tuple[bool, ...]) -> str:
    """A column's label where both modes are timed: rounds launched ahead of the bookkeeping or not."""
    return "" if len(modes) < 2 else (", ahead" if ahead else ", not ahead")


def round_breakdown(prof: Any, plain_step_ms: float) -> str:
    """A profiled run's mean round (exlpy/generator/speculative/profile.py) against its ideal: the draft steps plus
    one verification forward, each as the device ran them."""
    s = prof.summary()
    text = prof.describe(plain_step_ms)
    if "device draft" in s:
        ideal = s["device draft"] + s["device forward"]
        text += (f"; draft + forward {ideal:.3f} ms = {100 * ideal / s['wall']:.0f}% of the round; forward / plain "
                 f"step {s['device forward'] / plain_step_ms:.2f}; a draft step {s['device draft'] / s['k']:.3f} ms")
    return text


def verify_path(gen: Any) -> str:
    """Which verification the rounds used: the captured sampler's graph, or the host's `verify_rows` (also where
    the captured sampler failed and turned itself off)."""
    sampler = gen.stepper.graphed
    if sampler is None or getattr(sampler, "_verifier", None) is None:
        return "on the host (verify_rows)"
    return "captured, then failed: on the host" if sampler.failed else "captured (one graph per draft length)"


def breakdown_lines(items: list[str]) -> list[str]:
    if not items:
        return []
    return ["Mean round of each timed run (`RoundProfile`: device = CUDA events between a round's launches, idle "
            "time included; host = before (between rounds), prep, launch, wait (the read-back), after "
            "(accepting tokens)):", "", *items, ""]


def passage_text(tok: Any, path: str, n_tokens: int) -> str:
    text = Path(path).read_text(encoding="utf-8")
    ids = tok.encode(text[: n_tokens * 8])[0][:n_tokens]
    return tok.decode(ids)


def part_ngram(smol: str, passage_file: str, passage_tokens: int, label: str = "EXL2 4.0") -> list[str]:
    from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exlpy.generator.speculative.profile import RoundProfile

    config = ExLlamaV2Config(smol)
    config.max_seq_len = 4096
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=4096, lazy=True)
    model.load_autosplit(cache)
    tok = ExLlamaV2Tokenizer(config)
    passage = passage_text(tok, passage_file, passage_tokens)
    code = passage_text(tok, str(ROOT / "exlpy" / "generator" / "speculative" / "length.py"), passage_tokens)
    tasks = {"repeat": f"Repeat the following text exactly, word for word:\n\n{passage}",
             "light edit": "Copy the following text, but write the word \"Software\" in capital letters (SOFTWARE) "
                           f"every time it appears. Change nothing else:\n\n{passage}",
             "code edit": "Rewrite this Python code with the variable `rate` renamed to `acceptance`. Output the "
                          f"whole file:\n\n```python\n{code}\n```",
             "summary quoting": "Summarise the following text in a few paragraphs, quoting its key sentences "
                                f"word for word:\n\n{passage}"}
    greedy = ExLlamaV2Sampler.Settings.greedy()
    lines = [f"## (b) n-gram drafting, real SmolLM2-135M-Instruct {label}, batch 1", "",
             f"`{smol}`; a {passage_tokens}-token passage of `{passage_file}` in the prompt; greedy; up to "
             f"{passage_tokens + 100} new tokens. Plain = the same generator without drafting.", "",
             "| task | tokens | plain tok/s | n-gram tok/s | speedup | acceptance | draft length | same text |",
             "|---|---|---|---|---|---|---|---|"]
    breakdown: list[str] = []
    for task, instruction in tasks.items():
        text = tok.apply_chat_template([{"role": "user", "content": instruction}], add_generation_prompt=True)
        ids = tok.encode(text, add_bos=False, encode_special_tokens=True)
        runs = {}
        for name, kw in (("plain", {}), ("ngram", {"use_ngram_draft": True})):
            gen = ExLlamaV2DynamicGenerator(model, cache, tok, max_batch_size=1, **kw)
            for n in (16, passage_tokens + 100):  # warm-up (graphs), then the timed run
                gen.enqueue(js := [ExLlamaV2DynamicJob(ids, n, gen_settings=greedy)])
                gen.reset_sd_stats()
                if gen.spec is not None:
                    gen.spec.profile = RoundProfile()
                speed, out = drive(gen, js)
            runs[name] = (speed, out[js[0]], gen.spec.acceptance_per_token() if gen.spec else 0.0,
                          gen.spec.mean_draft_length() if gen.spec else 0.0)
            if gen.spec is not None and gen.spec.profile is not None:
                breakdown.append(f"- {task}: " + gen.spec.profile.describe(1000.0 / runs["plain"][0]))
        (ps, pt, _, _), (ns, nt, acc, k) = runs["plain"], runs["ngram"]
        target = "met" if ns >= 1.5 * ps else "**missed**"
        lines.append(f"| {task} | {len(nt)} | {ps:,.1f} | {ns:,.1f} | {ns / ps:.2f}x (target >= 1.5x: {target}) | "
                     f"{acc:.2f} | {k:.1f} | {'yes' if nt == pt else 'no'} |")
        print(lines[-1], flush=True)
    model.unload()
    return lines + [""] + breakdown_lines(breakdown)


def part_ngram8b(work: str, new_tokens: int) -> list[str]:
    """n-gram drafting on the 8B shape (random fp16 weights) under scripted repetitive texts
    (benchmarks/ngram_workloads.py), batch 1, against plain decoding under the same script."""
    from benchmarks.ngram_workloads import Script, workloads
    from exlpy import ExLlamaV2Cache, ExLlamaV2Tokenizer
    from exlpy.cli.bench import load_model
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from exlpy.generator.speculative.profile import RoundProfile

    seq = 256 * (-(-(1300 + new_tokens + 64) // 256))  # the prompts' ~1,210 tokens and the answer, in pages
    target = load_model(model_dir(work, "8b"), seq, 1)
    tok = ExLlamaV2Tokenizer(target.config)
    greedy = ExLlamaV2Sampler.Settings.greedy()
    lines = ["## (c) n-gram drafting on the 8B shape (random fp16 weights), scripted repetitive texts, batch 1", "",
             "The target's greedy text is scripted (benchmarks/ngram_workloads.py: a large logit on the script's "
             "token after every real forward pass, in plain decoding too), so the drafts meet a real repetitive "
             f"text and every cost is the real one. Up to {new_tokens} new tokens. Targets: >= 1.5x plain on the "
             "repetitive texts, >= 0.97x where acceptance is low.", "",
             "| workload | prompt / new tokens | plain tok/s | n-gram tok/s | speedup | acceptance | draft length | "
             "script followed |", "|---|---|---|---|---|---|---|---|"]
    breakdown: list[str] = []
    cache = ExLlamaV2Cache(target, max_seq_len=seq)
    for name, (prompt, answer) in workloads(target.config.vocab_size, answer_words=new_tokens).items():
        script = Script(target, prompt, answer)
        ids = torch.tensor([prompt], dtype=torch.long)
        runs = {}
        with script.active():
            for kind, kw in (("plain", {}), ("ngram", {"use_ngram_draft": True})):
                gen = ExLlamaV2DynamicGenerator(target, cache, tok, max_batch_size=1, **kw)
                for n in (24, len(answer)):  # warm-up (graphs of every draft length come as they are met), timed
                    gen.enqueue(js := [ExLlamaV2DynamicJob(ids, n, gen_settings=greedy, stop_conditions=[])])
                    gen.reset_sd_stats()
                    if gen.spec is not None:
                        gen.spec.profile = RoundProfile()
                    speed, out = drive(gen, js)
                runs[kind] = (speed, out[js[0]], gen.spec.acceptance_per_token() if gen.spec else 0.0,
                              gen.spec.mean_draft_length() if gen.spec else 0.0)
                if gen.spec is not None and gen.spec.profile is not None:
                    breakdown.append(f"- {name}: " + gen.spec.profile.describe(1000.0 / runs["plain"][0]))
                del gen
        (ps, pt, _, _), (ns, nt, acc, k) = runs["plain"], runs["ngram"]
        low = name.startswith("shuffled")
        goal = 0.97 if low else 1.5
        met = "met" if ns >= goal * ps else "**missed**"
        followed = "yes" if pt == nt == answer else f"no ({sum(a == b for a, b in zip(nt, answer))}/{len(answer)})"
        lines.append(f"| {name} | {len(prompt)} / {len(answer)} | {ps:,.1f} | {ns:,.1f} | {ns / ps:.2f}x (target >= "
                     f"{goal}x: {met}) | {acc:.2f} | {k:.1f} | {followed} |")
        print(lines[-1], flush=True)
    target.unload()
    return lines + [""] + breakdown_lines(breakdown)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="markdown results file")
    ap.add_argument("--parts", default="replay,ngram,ngram8b", help="comma list of: replay, ngram, ngram8b")
    ap.add_argument("--work", default="/tmp/exlpy_bench", help="where the random-weight models are written")
    ap.add_argument("--smol", default=None, help="SmolLM2-135M EXL2 dir (default: /tmp/smol, else ../shared)")
    ap.add_argument("--smollm2", default=None, help="part ngram: the real SmolLM2-135M-Instruct fp16 directory that "
                    "../shared/tools/smollm2_fp16.py builds (used instead of --smol)")
    ap.add_argument("--passage", default=None, help="text file for part ngram (default ../shared/eval/licenses.txt, "
                    "else this repository's README.md)")
    ap.add_argument("--quick", action="store_true", help="batch 1, acceptance 0.8, shorter runs")
    ap.add_argument("--batches", default=None, help="part replay: comma list of batch sizes (default 1,4,16)")
    ap.add_argument("--rates", default=None, help="part replay: comma list of acceptance rates a (default "
                    "0.5,0.7,0.8,0.9)")
    ap.add_argument("--new-tokens", type=int, default=None, help="parts replay and ngram8b: new tokens per job "
                    "(default 256; ngram8b 512)")
    ap.add_argument("--ahead", choices=("on", "off", "both"), default="on", help="part replay: rounds launched "
                    "ahead of the previous round's bookkeeping (the default), not, or both on the same models")
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
        batches = [int(x) for x in args.batches.split(",")] if args.batches else batches
        rates = [float(x) for x in args.rates.split(",")] if args.rates else rates
        n = args.new_tokens or n
        modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.ahead]
        body += part_replay(args.work, batches, rates, n,
                            lambda lines: Path(args.out).write_text("\n".join(header + body + lines) + "\n"), modes)
        Path(args.out).write_text("\n".join(header + body) + "\n")
    if "ngram" in parts:
        passage = args.passage or next(p for p in (str(SHARED / "eval" / "licenses.txt"), str(ROOT / "README.md"))
                                       if os.path.exists(p))
        model, label = (args.smollm2, "fp16") if args.smollm2 else (smol, "EXL2 4.0")
        body += part_ngram(model, passage, 300 if args.quick else 1000, label)
        Path(args.out).write_text("\n".join(header + body) + "\n")
    if "ngram8b" in parts:
        body += part_ngram8b(args.work, args.new_tokens or (128 if args.quick else 512))
    text = "\n".join(header + body) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
