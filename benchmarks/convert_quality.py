"""Quality of exlpy's EXL2 converter on real SmolLM2-135M-Instruct: perplexity (ANCHORS.md protocol) and mean
KL divergence to the source's next-token distribution, for the source, exlpy conversions at several bpw, the
exllamav2-made ../shared/models/smollm2-135m-exl2-4.0, and a round-to-nearest 4-bit g128 baseline.

    python benchmarks/convert_quality.py [--quick] [--windows N] [--rows 100 --length 2048 --mrows 16 --mlength 2048]

One measurement is made and reused for every bpw (-om then -m, as exllamav2 users do). Perplexity: consecutive
512-token windows of ../shared/eval/licenses.txt, every position but the first scored (--windows 0 = all 61, the
ANCHORS protocol). KL: mean over the positions of the first --kl-windows windows. Runs on a GPU when there is one
(fp16 there), else on the CPU in fp32. Results are written as they come (markdown + json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from exlpy import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer  # noqa: E402
from exlpy.convert import convert  # noqa: E402
from exlpy.convert.rtn import write_rtn_model  # noqa: E402

SHARED = os.path.join(os.path.dirname(ROOT), "shared")
EXL2_REF = os.path.join(SHARED, "models", "smollm2-135m-exl2-4.0")
WINDOW = 512
PREFIX = " (a prefix of the ANCHORS.md windows)"


def eval_model(path: str, ids: torch.Tensor, windows: int, kl_windows: int, ref_lp: list[torch.Tensor] | None,
               batch: int) -> tuple[float, float | None, list[torch.Tensor]]:
    """(perplexity, mean KL to ref_lp, log-probs of the first kl_windows windows)."""
    config = ExLlamaV2Config(path)
    model = ExLlamaV2(config)
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    model.load(device=dev)
    nll, count, kl_sum, kl_count, lps = 0.0, 0, 0.0, 0, []
    with torch.inference_mode():
        for w0 in range(0, windows, batch):
            n = min(batch, windows - w0)
            x = torch.stack([ids[WINDOW * (w0 + j):WINDOW * (w0 + j + 1)] for j in range(n)])
            lp = torch.log_softmax(model.forward(x).float()[:, :-1], -1).cpu()
            nll -= float(lp.gather(-1, x[:, 1:, None]).sum())
            count += x[:, 1:].numel()
            for j in range(n):
                wi = w0 + j
                if wi < kl_windows:
                    if ref_lp is None:
                        lps.append(lp[j].half())
                    else:
                        r = ref_lp[wi].float()
                        kl_sum += float((r.exp() * (r - lp[j])).sum())
                        kl_count += lp.shape[1]
    model.unload()
    return math.exp(nll / count), (kl_sum / kl_count if kl_count else None), lps


def file_bpw(path: str) -> float:
    """Bits per weight of the decoder's quantized tensors as stored (head and embedding excluded)."""
    from exlpy.weights.safetensors_index import SafetensorsIndex

    idx = SafetensorsIndex(path)
    bits = numel = 0
    cfg = ExLlamaV2Config(path).spec
    assert cfg is not None
    for name, info in idx.tensors.items():
        if name.startswith("model.layers.") and ".q_" in name:
            bits += info.nbytes * 8
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hk = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    numel = L * (h * hq * 2 + h * hk * 2 + 3 * h * i)
    return bits / numel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=os.path.join(ROOT, ".bench", "smollm2-fp16"))
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench", "convert_quality"))
    ap.add_argument("--bits", default="2.5,3.0,4.0,5.0,6.0,8.0")
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--mrows", type=int, default=16)
    ap.add_argument("--mlength", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=0, help="perplexity windows (0 = all: the ANCHORS protocol)")
    ap.add_argument("--kl-windows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="windows per forward")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4.0 bpw only, tiny calibration, 4 windows")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "convert_quality.md"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.bits, a.rows, a.length, a.mrows, a.mlength, a.windows, a.kl_windows = "4.0", 8, 256, 4, 256, 4, 2
    if not os.path.exists(os.path.join(a.source, "config.json")):
        subprocess.run([sys.executable, os.path.join(SHARED, "tools", "smollm2_fp16.py"), a.source], check=True)
    os.makedirs(a.work, exist_ok=True)
    tok = ExLlamaV2Tokenizer(ExLlamaV2Config(a.source))
    with open(os.path.join(SHARED, "eval", "licenses.txt"), encoding="utf-8") as f:
        ids = tok.encode(f.read())[0]
    windows = a.windows or ids.numel() // WINDOW
    kl_w = min(a.kl_windows, windows)
    dev = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
           else f"CPU ({platform.processor() or 'x86_64'}, {torch.get_num_threads()} threads)")
    cal = f"quant rows {a.rows} x {a.length}, measurement rows {a.mrows} x {a.mlength}, built-in calibration set"
    head = ["# EXL2 conversion quality: SmolLM2-135M-Instruct", "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- machine: {dev}; torch {torch.__version__}",
            f"- command: `python {' '.join(sys.argv)}`",
            f"- calibration: {cal}",
            f"- perplexity: {windows} windows of {WINDOW} tokens over ../shared/eval/licenses.txt"
            f"{' (all: the ANCHORS.md protocol)' if windows == ids.numel() // WINDOW else PREFIX}; "
            f"KL: mean over the {kl_w * (WINDOW - 1)} scored positions of the first {kl_w} windows", "",
            "| model | bpw (decoder, as stored) | head bits | perplexity | vs source | mean KL to source "
            "| time to make |",
            "|---|---|---|---|---|---|---|"]
    rows: list[dict] = []

    def write() -> None:
        lines = list(head)
        src = rows[0]["ppl"] if rows else None
        for r in rows:
            rel = f"{100 * (r['ppl'] / src - 1):+.1f}%" if src else ""
            kl = f"{r['kl']:.4f}" if r["kl"] is not None else "-"
            lines.append(f"| {r['name']} | {r['bpw']} | {r['hb']} | {r['ppl']:.3f} | {rel} | {kl} | {r['time']} |")
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump({"header": head[:6], "rows": rows}, f, indent=1)

    ppl, _, ref_lp = eval_model(a.source, ids, windows, kl_w, None, a.batch)
    rows.append({"name": "source (fp16)", "bpw": "16", "hb": "-", "ppl": ppl, "kl": 0.0, "time": "-"})
    write()
    print(rows[-1], flush=True)
    t0 = time.time()
    mdir = os.path.join(a.work, "measure")
    meas = os.path.join(mdir, "measurement.json")
    if not os.path.exists(meas):
        convert(a.source, mdir, output_measurement=True, measurement_rows=a.mrows, measurement_length=a.mlength,
                rows=a.rows, length=a.length)
    t_meas = time.time() - t0
    head.insert(6, f"- measurement (once, reused by every bpw): {t_meas:.0f} s")
    rtn = os.path.join(a.work, "rtn4-g128")
    if not os.path.exists(os.path.join(rtn, "config.json")):
        write_rtn_model(a.source, rtn, 4, 128, 6)
    order = [float(b) for b in a.bits.split(",")]
    order = sorted(order, key=lambda b: (b != 4.0, b != 3.0, b))
    def evaluate(made: list[tuple[str, str, str]]) -> None:
        for name, path, t in made:
            if not os.path.exists(path):
                continue
            p, kl, _ = eval_model(path, ids, windows, kl_w, ref_lp, a.batch)
            qc = json.load(open(os.path.join(path, "config.json"))).get("quantization_config", {})
            rows.append({"name": name, "bpw": f"{file_bpw(path):.3f}", "hb": qc.get("head_bits", "-"), "ppl": p,
                         "kl": kl, "time": t})
            write()
            print(rows[-1], flush=True)

    for b in order:  # each conversion is evaluated as soon as it exists, so a partial run still reports
        out = os.path.join(a.work, f"exlpy-{b:g}")
        t0 = time.time()
        if not os.path.exists(os.path.join(out, "config.json")):
            convert(a.source, os.path.join(a.work, f"job-{b:g}"), out, bits=b, head_bits=6, measurement=meas,
                    rows=a.rows, length=a.length, measurement_rows=a.mrows, measurement_length=a.mlength)
        made = [(f"exlpy {b:g} bpw", out, f"{time.time() - t0:.0f} s + measurement")]
        if b == 4.0:
            made += [("exllamav2 0.3.2, 4.0 bpw (../shared)", EXL2_REF, "-"),
                     ("RTN 4-bit g128 (exlpy format)", rtn, "-")]
        evaluate(made)


if __name__ == "__main__":
    main()
