"""lm-eval against `exlpy serve`, checked against exlpy's own forward pass.

EleutherAI's harness (`lm-eval run --model local-completions`, default settings: it finds the server's
/tokenizer_info and /tokenize and uses the server's tokenizer) runs two tasks from local files written here:
a multiple-choice task (`benchmarks/lm_eval/mc_questions.jsonl`, loglikelihood of each choice) and a
`loglikelihood_rolling` perplexity task (paragraphs of ../shared/eval/licenses.txt). Then the same quantities
are computed directly: the same token sequences (tokenized as lm-eval does: context and continuation from the
whole encoding, rolling windows from lm-eval's own window function) through `model.forward`, log-softmax,
summed; acc / acc_norm / word and byte perplexity aggregated as lm-eval aggregates them. Every per-request
loglikelihood and every metric must agree.

    python -m benchmarks.lm_eval_server [--model DIR] [--quick] [--out benchmarks/results/lm_eval_server.md]

Needs `pip install -e '.[eval,grammar,server]'`. Runs on the CPU (SmolLM2-135M EXL2 by default).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "smollm2-135m-exl2-4.0"
LICENSES = ROOT.parent / "shared" / "eval" / "licenses.txt"
MC_DATA = ROOT / "benchmarks" / "lm_eval" / "mc_questions.jsonl"
NAME = "smollm2"
MAX_LENGTH = 2048 - 1  # lm-eval's API models: max_length 2048 by default, one token kept for generation

MC_YAML = """task: exlpy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_YAML = """task: exlpy_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_tasks(work: Path, n_docs: int, quick: bool) -> tuple[list[dict[str, Any]], list[str]]:
    mc = [json.loads(line) for line in MC_DATA.read_text().splitlines() if line.strip()]
    if quick:
        mc = mc[:6]
    (work / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    paras = [p.strip() for p in re.split(r"\n\s*\n", LICENSES.read_text(encoding="utf-8")) if len(p.strip()) > 400]
    # One long document (> max_length tokens) so the rolling windows really roll.
    docs = paras[:n_docs - 1] + ["\n\n".join(paras[n_docs:n_docs + 40])]
    (work / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    (work / "exlpy_mc.yaml").write_text(MC_YAML.format(data=work / "mc.jsonl"))
    (work / "exlpy_ppl.yaml").write_text(PPL_YAML.format(data=work / "ppl.jsonl"))
    return mc, docs


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"exlpy serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("exlpy serve did not become ready")


# --- direct computation ---------------------------------------------------------------------------------------
class Direct:
    def __init__(self, model_dir: str) -> None:
        from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer

        cfg = ExLlamaV2Config(model_dir)
        self.model = ExLlamaV2(cfg)
        self.model.load_autosplit(ExLlamaV2Cache(self.model, max_seq_len=256, lazy=True))
        self.tok = ExLlamaV2Tokenizer(cfg)
        self.vocab = len(self.tok.get_id_to_piece_list(True))

    def encode(self, text: str) -> list[int]:
        from exlpy.tokenizer.hf_compat import hf_encode

        return hf_encode(self.tok, text, add_special_tokens=False)  # what lm-eval's remote tokenizer asks for

    def loglikelihood(self, context: list[int], continuation: list[int]) -> float:
        ids = (context + continuation)[-MAX_LENGTH:]
        lsm = torch.log_softmax(self.model.forward(torch.tensor([ids]))[0, :-1, :self.vocab].float(), dim=-1)
        target = torch.tensor(ids[1:])
        picked = lsm.gather(1, target.view(-1, 1)).view(-1)
        return float(picked[-len(continuation):].sum())

    def pair(self, context: str, continuation: str) -> float:
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return self.loglikelihood(ctx, whole[len(ctx):])

    def rolling(self, text: str) -> float:
        from lm_eval import utils

        prefix = self.tok.bos_token_id or self.tok.eos_token_id  # lm-eval's remote prefix_token_id
        windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            token_list=self.encode(text), prefix_token=prefix, max_seq_len=MAX_LENGTH - 1, context_len=1))
        return sum(self.loglikelihood(list(c), list(t)) for c, t in windows)


def direct_metrics(d: Direct, mc: list[dict[str, Any]], docs: list[str]) -> tuple[dict[str, float], list[Any]]:
    acc = acc_norm = 0
    per_request: list[Any] = []
    for doc in mc:
        context = f"Question: {doc['question']}\nAnswer:"
        lls = [d.pair(context, " " + c) for c in doc["choices"]]
        per_request.append(lls)
        acc += int(max(range(len(lls)), key=lambda i: lls[i]) == doc["answer"])
        norm = [ll / len(c) for ll, c in zip(lls, doc["choices"])]
        acc_norm += int(max(range(len(norm)), key=lambda i: norm[i]) == doc["answer"])
    lls = [d.rolling(t) for t in docs]
    per_request.append(lls)
    words = sum(len(re.split(r"\s+", t)) for t in docs)
    nbytes = sum(len(t.encode("utf-8")) for t in docs)
    return {"acc": acc / len(mc), "acc_norm": acc_norm / len(mc), "word_perplexity": math.exp(-sum(lls) / words),
            "byte_perplexity": math.exp(-sum(lls) / nbytes),
            "bits_per_byte": -sum(lls) / nbytes / math.log(2)}, per_request


def lm_eval_samples(out_dir: Path, task: str) -> list[dict[str, Any]]:
    files = sorted(glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    return [json.loads(line) for line in Path(files[-1]).read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--quick", action="store_true", help="6 questions and 3 documents")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_eval_server.md"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exlpy_lm_eval_"))
    mc, docs = write_tasks(work, 3 if args.quick else 8, args.quick)
    url = f"http://127.0.0.1:{args.port}"
    serve_cmd = [sys.executable, "-m", "exlpy", "serve", "--model", args.model, "--port", str(args.port),
                 "--served-model-name", NAME, "--log-level", "warning"]
    eval_cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
                f"model={NAME},base_url={url}/v1/completions", "--tasks", "exlpy_mc,exlpy_ppl", "--include_path",
                str(work), "--output_path", str(work / "out"), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    server = subprocess.Popen(serve_cmd, env=env)
    try:
        wait_ready(url, server)
        t0 = time.monotonic()
        subprocess.run(eval_cmd, env=env, check=True)
        eval_s = time.monotonic() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    result_file = sorted(glob.glob(str(work / "out" / "**" / "results_*.json"), recursive=True))[-1]
    results = json.loads(Path(result_file).read_text())
    ours = {**results["results"]["exlpy_mc"], **results["results"]["exlpy_ppl"]}
    theirs = {k.split(",")[0]: v for k, v in ours.items() if "," in k and "stderr" not in k}

    direct, per_request = direct_metrics(Direct(args.model), mc, docs)
    mc_samples = sorted(lm_eval_samples(work / "out", "exlpy_mc"), key=lambda s: s["doc_id"])
    ppl_samples = sorted(lm_eval_samples(work / "out", "exlpy_ppl"), key=lambda s: s["doc_id"])
    worst = 0.0
    for s, lls in zip(mc_samples, per_request[:-1]):
        got = [r[0][0] if isinstance(r[0], list) else r[0] for r in s["resps"]]
        worst = max(worst, *(abs(float(a) - b) for a, b in zip(got, lls)))
    for s, ll in zip(ppl_samples, per_request[-1]):
        got = s["resps"][0][0]
        worst = max(worst, abs(float(got[0] if isinstance(got, list) else got) - ll))
    n_requests = sum(len(x) for x in per_request)
    rows = [f"| {k} | {theirs[k]:.6f} | {direct[k]:.6f} | {abs(theirs[k] - direct[k]):.2e} |" for k in direct]
    ok = worst < 1e-3 and all(abs(theirs[k] - direct[k]) <= 1e-4 * max(1.0, abs(direct[k])) for k in direct)
    report = "\n".join([
        "# lm-eval (local-completions) against exlpy serve, checked against exlpy's forward pass", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- device: CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}",
        f"- model: `{args.model}`",
        f"- server: `{' '.join(serve_cmd)}`", f"- harness: `{' '.join(eval_cmd)}` ({eval_s:.0f} s)",
        f"- tasks: exlpy_mc ({len(mc)} questions x 4 choices, loglikelihood), exlpy_ppl ({len(docs)} documents of "
        "../shared/eval/licenses.txt, loglikelihood_rolling; the last one is longer than max_length 2048, so its "
        "windows roll)",
        f"- one command: `python -m benchmarks.lm_eval_server{' --quick' if args.quick else ''}`", "",
        "| metric | lm-eval via the server | exlpy forward pass directly | difference |", "|---|---|---|---|",
        *rows, "",
        f"Largest difference of a single loglikelihood over all {n_requests} requests: {worst:.2e}.",
        f"Result: {'PASS' if ok else 'FAIL'} (per-request tolerance 1e-3, metrics 1e-4 relative).", ""])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
