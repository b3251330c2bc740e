"""Quality of exlpy's EXL2 converter on real SmolLM2-135M-Instruct: perplexity (ANCHORS.md protocol) and mean
KL divergence to the source's next-token distribution, for the source, exlpy conversions at several bpw, the
exllamav2-made ../shared/models/smollm2-135m-exl2-4.0, and a round-to-nearest 4-bit g128 baseline.

    python benchmarks/convert_quality.py [--quick] [--windows N] [--rows 100 --length 2048 --mrows 16 --mlength 2048]
        [--bits 2.5,3.0,...] [--set learned_rounding=0 ...] [--measurement FILE] [--no-refs] [--work DIR]

The issue-34 table on one GPU (full protocol: the defaults), in two calls of under 10 minutes that share --work:

    python benchmarks/convert_quality.py --bits 4.0,3.0          # measurement, exllamav2 and RTN rows, 4.0, 3.0
    python benchmarks/convert_quality.py --bits 2.5,5.0,6.0      # the table then holds every row

One measurement is made and reused for every bpw (-om then -m, as exllamav2 users do). The run is resumable and
can be split over several calls with the same --work: finished conversions and evaluated rows are kept there
(WORK/rows.json) and only the source is evaluated again; the table and the plot (a PNG beside --out, when
matplotlib is installed) always list every row evaluated so far. Perplexity: consecutive
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
KEEP = "<!-- notes: kept when the table above is regenerated -->"


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


def _setting(kv: str) -> tuple[str, object]:
    key, _, value = kv.partition("=")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def plot(rows: list[dict], path: str, title: str) -> None:
    """Perplexity against stored bpw: the exlpy curve, the other converters as points, the source as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ours = sorted((float(r["bpw"]), r["ppl"]) for r in rows if r["name"].startswith("exlpy"))
    if ours:
        ax.plot(*zip(*ours), "o-", label="exlpy convert")
    for r, marker in ((r, "s" if "exllamav2" in r["name"] else "^") for r in rows
                      if not r["name"].startswith(("exlpy", "source"))):
        ax.plot([float(r["bpw"])], [r["ppl"]], marker, label=r["name"])
    src = [r["ppl"] for r in rows if r["name"].startswith("source")]
    if src:
        ax.axhline(src[0], color="gray", ls="--", label="source (fp16)")
    ax.set_xlabel("bits per weight (decoder, as stored)")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter

    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=os.path.join(ROOT, ".bench", "smollm2-fp16"))
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench", "convert_quality"))
    ap.add_argument("--bits", default="2.5,3.0,4.0,5.0,6.0")
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
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a ConvertSettings field for the measurement and every conversion (A/B runs), e.g. "
                    "learned_rounding=0; values are parsed as JSON, else kept as text")
    ap.add_argument("--measurement", help="reuse this measurement.json instead of measuring in WORK/measure")
    ap.add_argument("--no-refs", action="store_true", help="skip the exllamav2 and RTN rows")
    ap.add_argument("--replot", action="store_true", help="only draw the PNG from the .json beside --out (e.g. "
                    "on a machine with matplotlib, after a run on one without)")
    a = ap.parse_args()
    if a.replot:
        data = json.load(open(os.path.splitext(a.out)[0] + ".json"))
        plot(data["rows"], os.path.splitext(a.out)[0] + ".png", data.get("title", "SmolLM2-135M-Instruct"))
        return
    extra = dict(_setting(kv) for kv in a.set)
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
            f"- calibration: {cal}" + (f"; settings {extra}" if extra else ""),
            f"- perplexity: {windows} windows of {WINDOW} tokens over ../shared/eval/licenses.txt"
            f"{' (all: the ANCHORS.md protocol)' if windows == ids.numel() // WINDOW else PREFIX}; "
            f"KL: mean over the {kl_w * (WINDOW - 1)} scored positions of the first {kl_w} windows", "",
            "| model | bpw (decoder, as stored) | head bits | perplexity | vs source | mean KL to source "
            "| time to make |",
            "|---|---|---|---|---|---|---|"]
    title = f"SmolLM2-135M-Instruct, {windows} windows of {WINDOW} tokens"
    rows: list[dict] = []
    cache_path = os.path.join(a.work, "rows.json")
    cache: dict = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    prev = os.path.splitext(a.out)[0] + ".json"
    if not cache and os.path.exists(prev):
        # A fresh work dir (another machine): carry on with the rows an earlier call wrote beside --out, when
        # they were made with this calibration.
        old = json.load(open(prev))
        if old.get("calibration") == head[5] and isinstance(old.get("cache"), dict):
            cache = old["cache"]

    def table() -> list[dict]:
        """The source, then every row this work dir has evaluated with this protocol: exlpy by bpw, then the
        other converters (rows of earlier calls with other --bits included)."""
        mine = [v for k, v in cache.items() if k.endswith(f" @ {windows}/{kl_w}")]
        return rows[:1] + sorted(mine, key=lambda r: (not r["name"].startswith("exlpy"), float(r["bpw"])))

    def write() -> None:
        lines = list(head)
        out = table()
        src = out[0]["ppl"] if out else None
        for r in out:
            rel = f"{100 * (r['ppl'] / src - 1):+.1f}%" if src else ""
            kl = f"{r['kl']:.4f}" if r["kl"] is not None else "-"
            lines.append(f"| {r['name']} | {r['bpw']} | {r['hb']} | {r['ppl']:.3f} | {rel} | {kl} | {r['time']} |")
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        kept = ""
        if os.path.exists(a.out):  # notes below the marker (the A/B record) survive a regenerated table
            text = open(a.out, encoding="utf-8").read()
            if KEEP in text:
                kept = "\n" + text[text.index(KEEP):]
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n" + kept)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump({"header": head[:8], "rows": out, "calibration": head[5], "cache": cache, "title": title}, f,
                      indent=1)
        with open(cache_path, "w") as f:
            json.dump(cache, f, indent=1)
        plot(out, os.path.splitext(a.out)[0] + ".png", title)

    ppl, _, ref_lp = eval_model(a.source, ids, windows, kl_w, None, a.batch)
    rows.append({"name": "source (fp16)", "bpw": "16", "hb": "-", "ppl": ppl, "kl": 0.0, "time": "-"})
    write()
    print(rows[-1], flush=True)
    t0 = time.time()
    mdir = os.path.join(a.work, "measure")
    meas = a.measurement or os.path.join(mdir, "measurement.json")
    if not os.path.exists(meas):
        convert(a.source, mdir, output_measurement=True, measurement_rows=a.mrows, measurement_length=a.mlength,
                rows=a.rows, length=a.length, **extra)
        cache["measure_s"] = time.time() - t0
    t_meas = f"{cache['measure_s']:.0f} s" if "measure_s" in cache else f"reused from {meas}"
    head.insert(6, f"- measurement (once, reused by every bpw): {t_meas}")
    rtn = os.path.join(a.work, "rtn4-g128")
    if not a.no_refs and not os.path.exists(os.path.join(rtn, "config.json")):
        write_rtn_model(a.source, rtn, 4, 128, 6)
    order = [float(b) for b in a.bits.split(",")]
    order = sorted(order, key=lambda b: (b != 4.0, b != 3.0, b))

    def evaluate(made: list[tuple[str, str, str]]) -> None:
        for name, path, t in made:
            if not os.path.exists(path):
                continue
            key = f"{name} @ {windows}/{kl_w}"
            if key not in cache:
                p, kl, _ = eval_model(path, ids, windows, kl_w, ref_lp, a.batch)
                qc = json.load(open(os.path.join(path, "config.json"))).get("quantization_config", {})
                cache[key] = {"name": name, "bpw": f"{file_bpw(path):.3f}", "hb": qc.get("head_bits", "-"),
                              "ppl": p, "kl": kl, "time": t}
            write()
            print(cache[key], flush=True)

    for b in order:  # each conversion is evaluated as soon as it exists, so a partial run still reports
        out = os.path.join(a.work, f"exlpy-{b:g}")
        t0 = time.time()
        if not os.path.exists(os.path.join(out, "config.json")):
            convert(a.source, os.path.join(a.work, f"job-{b:g}"), out, bits=b, head_bits=6, measurement=meas,
                    rows=a.rows, length=a.length, measurement_rows=a.mrows, measurement_length=a.mlength, **extra)
            cache[f"time {b:g}"] = f"{time.time() - t0:.0f} s + measurement"
        made = [(f"exlpy {b:g} bpw", out, cache.get(f"time {b:g}", "-"))]
        if b == 4.0 and not a.no_refs:
            made += [("exllamav2 0.3.2, 4.0 bpw (../shared)", EXL2_REF, "-"),
                     ("RTN 4-bit g128 (exlpy format)", rtn, "-")]
        evaluate(made)


if __name__ == "__main__":
    main()
