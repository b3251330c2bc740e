"""Time one decoder layer of the EXL2 converter, phase by phase, on a random-weight model of a real shape.

Runs what the job runs for one layer (`measure_module` on the attention and the MLP over the measurement rows,
then `quantize_module` on both with a ~4 bpw option over the quantization rows, then the states checkpoint
write), on random hidden states, and reports each phase's wall time (the device synchronized at phase ends),
how many torch operations each phase issued (on a GPU each is one kernel launch or more: with `--count-ops`),
and the projected whole conversion: layers x (measure + quantize) + head. The source check and the checkpoint
write are timed too but left out of the sums: the pipeline runs them beside the device's work.

    python benchmarks/convert_layer.py --shape llama3-70b --head     # GPU: per-layer times, 70B projection
    python benchmarks/convert_layer.py --shape llama3-8b --head      # also time the head's quantization
    OMP_NUM_THREADS=1 python benchmarks/convert_layer.py --shape tiny-8b --count-ops --rows 2 --mrows 1 \
        --length 256 --device cpu                                    # CPU profile of the same structure

`--count-gptq-ops`: only the op counts of one layer's GPTQ calls, on meta tensors (no compute; any machine).

Shapes: make_models' (llama3-8b, llama3.2-1b, smollm2-135m), llama3-70b, and `tiny-8b` (the 8B's
proportions at 1/8 of its widths: the same option tables and group layouts per row, CPU-sized). The model is
written once under --work with one layer (and the shape's full vocabulary only with --head).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_models  # noqa: E402

make_models.SHAPES.setdefault("llama3-70b", dict(
    hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0))
make_models.SHAPES.setdefault("tiny-8b", dict(
    hidden_size=512, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
    intermediate_size=1792, vocab_size=16032, tie_word_embeddings=False, rope_theta=500000.0))


# Phases the pipeline runs beside the device's work (a module ahead; in the background writer): timed and listed,
# left out of the per-layer sums.
OVERLAPPED = ("source check (prefetched in the pipeline)", "states checkpoint write (background in the pipeline)")


class Phases:
    """Wall time and torch op count per phase name; nested phases count in the innermost only."""

    def __init__(self, device: torch.device, count_ops: bool) -> None:
        self.device = device
        self.count_ops = count_ops
        self.time: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)
        self.syncs: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []
        self.t_last = 0.0
        self.fused = False  # inside a fused op: its torch reference's operations are one launch on a GPU

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _switch(self) -> None:
        now = time.perf_counter()
        if self.stack:
            self.time[self.stack[-1]] += now - self.t_last
        self.t_last = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        self._switch()
        self.stack.append(name)
        try:
            yield
        finally:
            self._sync()
            self._switch()
            self.stack.pop()

    def wrap(self, mod: Any, attr: str, name: str) -> None:
        fn = getattr(mod, attr)

        def wrapped(*a: Any, **k: Any) -> Any:
            with self.phase(name):
                return fn(*a, **k)

        setattr(mod, attr, wrapped)

    def fuse(self, mod: Any, attr: str) -> None:
        """Count `mod.attr` as one op: on CPU its torch reference runs, on a GPU its one kernel."""
        fn = getattr(mod, attr)

        def wrapped(*a: Any, **k: Any) -> Any:
            if self.count_ops and not self.fused:
                self.ops[self.stack[-1] if self.stack else "other"] += 1
            self.fused = True
            try:
                return fn(*a, **k)
            finally:
                self.fused = False

        setattr(mod, attr, wrapped)


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten operations (on CUDA: kernel launches, roughly) and host syncs (.item(), bool(), .cpu())."""

    SYNCS = ("_local_scalar_dense", "is_nonzero")

    def __init__(self, phases: Phases) -> None:
        super().__init__()
        self.phases = phases

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.phases.fused:
            return func(*args, **(kwargs or {}))
        name = self.phases.stack[-1] if self.phases.stack else "other"
        self.phases.ops[name] += 1
        fname = func.__name__
        if any(s in fname for s in self.SYNCS) or (fname.startswith("_to_copy") and self._to_host(args, kwargs)):
            self.phases.syncs[name] += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _to_host(args: Any, kwargs: Any) -> bool:
        dev = (kwargs or {}).get("device")
        return bool(args) and getattr(args[0], "is_cuda", False) and dev is not None and dev.type == "cpu"


def pick_option(options: list[dict], module: Any, target: float) -> dict:
    """The option of the table whose bpw is nearest `target` (what the optimizer picks around 4 bpw)."""
    from exlpy.convert.layers import module_bits, module_numel

    n = module_numel(module)
    return min(options, key=lambda o: abs(module_bits(module, o) / n - target))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--work", default="/tmp/exlpy_convert_layer")
    ap.add_argument("--rows", type=int, default=100, help="quantization rows (converter default 100)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--mrows", type=int, default=16, help="measurement rows (converter default 16)")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--count-ops", action="store_true", help="count torch ops and host syncs per phase")
    ap.add_argument("--head", action="store_true", help="also quantize the head (full vocabulary)")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=1, help="time the layer this many times (first run warms up)")
    ap.add_argument("--out", default="", help="append the table to this markdown file")
    ap.add_argument("--count-gptq-ops", action="store_true",
                    help="only count the torch ops of one layer's GPTQ passes at this shape, on meta tensors (no "
                         "compute, no model): measurement (every option) and quantization (a ~4 bpw option, both "
                         "act orders)")
    a = ap.parse_args()
    if a.count_gptq_ops:
        count_gptq_ops(make_models.SHAPES[a.shape])
        return

    from exlpy.config.config import ExLlamaV2Config
    from exlpy.convert import measure as measure_mod
    from exlpy.convert import quantize as quantize_mod
    from exlpy.convert.forward import Hessian, States
    from exlpy.convert.job import write_tensors
    from exlpy.convert.layers import OPTIONS, is_decoder
    from exlpy.convert.settings import ConvertSettings
    from exlpy.engine import ExLlamaV2
    from exlpy.kernels import ops

    device = torch.device(a.device)
    shape = dict(make_models.SHAPES[a.shape])
    n_layers = shape["num_hidden_layers"]
    full_vocab = shape["vocab_size"]
    vocab = full_vocab if a.head else 1024
    name = f"{a.shape}-1l-v{vocab}"
    make_models.SHAPES[name] = dict(shape, num_hidden_layers=1, vocab_size=vocab)
    model_dir = os.path.join(a.work, name)
    t0 = time.perf_counter()
    make_models.write_model(model_dir, name)
    t_build = time.perf_counter() - t0

    ph = Phases(device, a.count_ops)
    ph.wrap(measure_mod, "forward_chunks", "forward (reference + Hessian)")
    ph.wrap(measure_mod, "output_errors", "forward per option + error")
    ph.wrap(measure_mod, "gptq_quantize", "GPTQ (all options)")
    ph.wrap(measure_mod, "prepare_hessian", "Hessian factorization")
    ph.wrap(measure_mod, "check_source", OVERLAPPED[0])
    ph.wrap(measure_mod, "read_weight", "weight read")
    ph.wrap(quantize_mod, "forward_chunks", "forward (Hessian / outputs)")
    ph.wrap(quantize_mod, "quantize_best_order", "GPTQ + act order choice")
    ph.wrap(quantize_mod, "check_source", OVERLAPPED[0])
    ph.wrap(quantize_mod, "read_weight", "weight read")
    ph.wrap(quantize_mod, "pack_exl2", "pack + check")
    ph.wrap(quantize_mod, "run_chunk", "forward (error of chunk 0)")
    if hasattr(ops, "gptq_block"):
        ph.fuse(ops, "gptq_block")
    add = Hessian.add

    def hadd(self: Hessian, x: torch.Tensor) -> None:
        with ph.phase("Hessian accumulation"):
            add(self, x)

    Hessian.add = hadd  # type: ignore[method-assign]

    s = ConvertSettings()
    config = ExLlamaV2Config(model_dir)
    model = ExLlamaV2(config)
    attn, mlp = [m for m in model.modules if is_decoder(m)]
    h = shape["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    store = device

    def states(rows: int) -> States:
        step = max(1, (16384 if device.type == "cuda" else 4096) // a.length)
        return States([torch.randn(min(step, rows - r), a.length, h, generator=gen).half().to(device)
                       for r in range(0, rows, step)])

    inputs = {"measure": states(a.mrows), "quantize": states(a.rows)}
    outputs: dict[str, States] = {}
    counter = _OpCounter(ph) if a.count_ops else contextlib.nullcontext()
    results = []
    for _ in range(a.repeat):
        ph.time.clear(), ph.ops.clear(), ph.syncs.clear()
        stage_t: dict[str, float] = {}
        with torch.inference_mode(), counter:
            for stage in ("measure", "quantize"):
                for m in (attn, mlp):
                    key = f"{stage} {'attn' if m is attn else 'mlp'}"
                    t1 = time.perf_counter()
                    over0 = sum(ph.time[k] for k in OVERLAPPED)
                    with ph.phase(f"{key}: other"):
                        with ph.phase("module load"):
                            m.load(device)
                        x = inputs[stage] if m is attn else outputs[stage]
                        if stage == "measure":
                            _, out = measure_mod.measure_module(m, x, device, store, s.damp, s.scale_norm)
                        else:
                            opt = pick_option(OPTIONS[type(m)], m, a.bits)
                            _, out, _ = quantize_mod.quantize_module(m, x, device, store, opt, s.damp, s.scale_norm,
                                                                     s.act_order)
                        outputs[stage] = out
                        m.unload()
                        if m is mlp:
                            with ph.phase(OVERLAPPED[1]):
                                write_tensors(os.path.join(a.work, f"states_{stage}.safetensors"), out.to_dict())
                    stage_t[key] = time.perf_counter() - t1 - (sum(ph.time[k] for k in OVERLAPPED) - over0)
        results.append((dict(ph.time), dict(ph.ops), dict(ph.syncs), stage_t))
    times, ops, syncs, stage_t = results[-1]
    head_t = None
    if a.head:
        head_t = time_head(model, outputs["quantize"], device, s)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.get_num_threads()} threads)"
    lines = [f"\n### One {a.shape} layer (hidden {h}, intermediate {shape['intermediate_size']}, "
             f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads), random weights",
             "", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; device: {dev_name}; "
             f"torch {torch.__version__}",
             f"- command: `python benchmarks/convert_layer.py {' '.join(sys.argv[1:])}`",
             f"- rows: measurement {a.mrows} x {a.length}, quantization {a.rows} x {a.length}; option ~{a.bits} bpw; "
             f"model build {t_build:.0f} s; run {a.repeat} of {a.repeat} shown", "",
             "| phase | seconds | torch ops | host syncs |", "|---|---|---|---|"]
    for k in sorted(times, key=lambda k: -times[k]):
        lines.append(f"| {k} | {times[k]:.3f} | {ops.get(k, 0) if a.count_ops else '-'} | "
                     f"{syncs.get(k, 0) if a.count_ops else '-'} |")
    lines += ["", "| module (without the overlapped phases) | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in stage_t.items()]
    layer = sum(stage_t.values())
    lines.append(f"| **one layer** | **{layer:.2f}** |")
    if head_t is not None:
        lines.append(f"| head (vocabulary {full_vocab}) | {head_t:.2f} |")
    proj = layer * n_layers + (head_t or 0.0)
    lines.append(f"| projected {n_layers} layers{' + head' if head_t is not None else ' (head not timed)'} | "
                 f"{proj:,.0f} ({proj / 60:.1f} min, {proj / 3600:.2f} h) |")
    if device.type == "cuda":
        lines.append(f"| peak GPU allocated | {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text)


def count_gptq_ops(shape: dict) -> None:
    """Torch ops (on a GPU: launches) of one layer's GPTQ calls, counted on meta tensors."""
    from exlpy.convert import gptq
    from exlpy.convert.qparams import ATTN_KEYS, ATTN_OPTIONS, MLP_OPTIONS, distinct
    from exlpy.kernels import ops

    ph = Phases(torch.device("meta"), True)
    if hasattr(ops, "gptq_block"):
        ph.fuse(ops, "gptq_block")
    h, im = shape["hidden_size"], shape["intermediate_size"]
    hq, hk = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    groups = [(("q_proj", "k_proj", "v_proj"), h, (hq, hk, hk)), (("o_proj",), hq, (h,)),
              (("gate_proj", "up_proj"), h, (im, im)), (("down_proj",), im, (h,))]
    meta = torch.device("meta")

    def count(k: int, ns: list[int], opts: list) -> int:
        p = gptq.PreparedHessian(torch.arange(k), torch.empty(k, k, device=meta), torch.empty(k, device=meta))
        ph.ops.clear()
        with _OpCounter(ph):
            gptq.gptq_quantize([torch.empty(k, n, device=meta) for n in ns], opts, p)
        return ph.ops["other"]

    total = {"measure": 0, "quantize": 0}
    for keys, k, ns in groups:
        table = ATTN_OPTIONS if keys[0] in ATTN_KEYS else MLP_OPTIONS
        opts, widths = [], []
        for key, n in zip(keys, ns):
            d = distinct(table, key)
            opts += d
            widths += [n] * len(d)
        m = count(k, widths, opts)
        q = 2 * count(k, list(ns), [table[7][key] for key in keys])
        total["measure"] += m
        total["quantize"] += q
        print(f"{'/'.join(keys):24s} K {k:6d}: measurement {m:9,d} ops, quantization {q:9,d} ops")
    print(f"one layer: measurement {total['measure']:,d} ops, quantization {total['quantize']:,d} ops")


def time_head(model: Any, states: Any, device: torch.device, s: Any) -> float:
    """The head's quantization as the job runs it (Hessian of the final norm's output, vocabulary slices)."""
    from exlpy.convert.layers import is_decoder, shapes
    from exlpy.convert.quantize import head_hessian, quantize_head

    t0 = time.perf_counter()
    with torch.inference_mode():
        norm = model.modules[-2]
        norm.load(device)
        h = head_hessian(norm, states, device)
        norm.unload()
        spec = model.config.spec
        decoders = [m for m in model.modules if is_decoder(m)]
        widest = max(k * n for m in decoders for k, n in shapes(m).values())
        cols = max(32, widest // spec.hidden_size // 32 * 32)
        quantize_head(model.config.index, "lm_head.weight", h.result(), 6, device, cols, s.damp, s.scale_norm)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
