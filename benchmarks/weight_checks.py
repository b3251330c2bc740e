"""What the load-time NaN/inf check of every floating weight costs (exlpy/weights/checks.py).

Loads one model repeatedly with the check on and off (EXLPY_SKIP_WEIGHT_CHECKS), alternating so that page-cache
and machine-load drift hit both alike, and reports the median load time of each plus the time spent inside the
checks themselves (measured directly: the sums, their one sync per module, and the close look at none).

    python benchmarks/weight_checks.py --model ../shared/models/smollm2-135m-exl2-4.0 --device cpu
    python benchmarks/weight_checks.py --quick      # 3 loads each
    python benchmarks/weight_checks.py --device cuda:0 --model /path/to/8B   # on a GPU machine

Writes a results file (device, date, command) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exlpy import (  # noqa: E402
    ExLlamaV2,
    ExLlamaV2Config,
    runtime,  # noqa: E402
)
from exlpy.weights import checks  # noqa: E402


def load_once(model_dir: str, device: str, check: bool) -> tuple[float, float, int]:
    """(load seconds, seconds inside the checks, bytes checked)."""
    opts = runtime.RuntimeOptions.from_env({"EXLPY_SKIP_WEIGHT_CHECKS": "0" if check else "1"})
    spent = {"s": 0.0, "bytes": 0}
    real_landed, real_verify = checks.landed, checks.verify

    def landed(index, name, t):  # noqa: ANN001, ANN202 - timing wrapper
        t0 = time.perf_counter()
        out = real_landed(index, name, t)
        if t is not None and t.is_floating_point() and check:
            spent["bytes"] += t.numel() * t.element_size()
        spent["s"] += time.perf_counter() - t0
        return out

    def verify(pending):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        real_verify(pending)
        spent["s"] += time.perf_counter() - t0

    names = ("exlpy.model.linear", "exlpy.model.attention", "exlpy.model.embedding", "exlpy.quant.exl2",
             "exlpy.quant.gptq")
    mods = [sys.modules[m] for m in names if m in sys.modules]
    for m in mods:
        m.landed = landed  # type: ignore[attr-defined]
    checks.verify = verify  # type: ignore[assignment]
    try:
        config = ExLlamaV2Config(model_dir)
        model = ExLlamaV2(config)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with runtime.use_options(opts):
            model.load(device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        model.unload()
        return dt, spent["s"], spent["bytes"]
    finally:
        for m in mods:
            m.landed = real_landed  # type: ignore[attr-defined]
        checks.verify = real_verify  # type: ignore[assignment]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "smollm2-135m-exl2-4.0"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="3 loads each")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/weight_checks_<dev>.md)")
    a = p.parse_args()
    n = 3 if a.quick else a.repeat
    import exlpy.quant.exl2  # noqa: F401 - so the timing wrapper reaches the quantized loaders too
    import exlpy.quant.gptq  # noqa: F401

    load_avg = os.getloadavg()
    load_once(a.model, a.device, True)  # warm the page cache and imports
    on, off, inside, nbytes = [], [], [], 0
    for _ in range(n):
        dt, s, nbytes = load_once(a.model, a.device, True)
        on.append(dt)
        inside.append(s)
        off.append(load_once(a.model, a.device, False)[0])
    dev = torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    med_on, med_off, med_in = statistics.median(on), statistics.median(off), statistics.median(inside)
    lines = [
        "# Load-time NaN/inf weight check: cost",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- device: {dev}, torch {torch.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- model: `{a.model}`; floating tensors checked: {nbytes / 1e6:.1f} MB (in their loaded dtype)",
        f"- loads: {n} with the check and {n} without, alternating; load average before: "
        f"{' '.join(f'{x:.1f}' for x in load_avg)} (a shared machine)",
        "",
        "| | median load (s) | all loads (s) |",
        "|---|---|---|",
        f"| check on | {med_on:.3f} | {', '.join(f'{x:.3f}' for x in on)} |",
        f"| check off (EXLPY_SKIP_WEIGHT_CHECKS=1) | {med_off:.3f} | {', '.join(f'{x:.3f}' for x in off)} |",
        f"| time inside the check | {med_in:.3f} | {', '.join(f'{x:.3f}' for x in inside)} |",
        "",
        f"Time inside the check: {med_in * 1e3:.1f} ms per load = {100 * med_in / med_on:.1f}% of the load, "
        f"{nbytes / 1e9 / max(med_in, 1e-9):.1f} GB/s over the checked bytes.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"weight_checks_{a.device.split(':')[0]}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
