"""Runtime switches: every environment variable exlpy honours, read once into one frozen object.

The process-wide snapshot is taken the first time `options()` is called and never re-read, so a variable set
halfway through a run cannot change behaviour between two forward passes. Code that wants other settings
(tests, benchmarks comparing variants) passes an explicit `RuntimeOptions` down, or wraps a block in
`use_options(...)`.

| variable | field | meaning |
|---|---|---|
| `EXLLAMA_NO_GRAPHS` | `no_graphs` | default of `config.no_graphs`: decode without CUDA graphs |
| `EXLLAMA_NO_FLASH_ATTN` / `_XFORMERS` / `_SDPA` | `no_flash_attn` ... | exllamav2's config defaults (informational) |
| `EXLPY_NO_TRITON=1` | `triton=False` | CUDA tensors use the torch references instead of Triton kernels |
| `EXLPY_PDL=0` | `pdl=False` | no programmatic dependent launch on Hopper |
| `EXLPY_TP_COMM=local\\|host\\|nccl\\|peer\\|hostmem` | `tp_comm` | TP collective backend (default: the fastest) |
| `EXLPY_TP_MODE=row\\|column` | `tp_layout` | how TP splits a block's closing projection (row for dense) |
| `EXLPY_TP_NO_GRAPHS=1` | `tp_graphs=False` | tensor-parallel decode without CUDA graphs |
| `EXLPY_TP_PIPELINE=1` | `tp_pipeline=True` | TP prefill in two micro-batches, all-reduces overlapping compute |
| `EXLPY_TP_OVERLAP=N` | `tp_overlap_chunks=N` | TP prefill: closing products in N row chunks, sums beside GEMMs |
| `EXLPY_TP_PREFILL_COMM=copy` | `tp_prefill_comm` | 2-GPU TP prefill all-reduces by copy-engine peer copies + an add |
| `EXLPY_TP_FUSE_NORM=1` | `tp_fuse_norm=True` | TP batched decode: the next RMSNorm inside the all-reduce |
| `EXLPY_NO_CPU_WARNING=1` | `cpu_warning=False` | no warning when torch has no GPU backend |
| `EXLPY_SKIP_WEIGHT_CHECKS=1` | `weight_checks=False` | no NaN/inf check of the weights at load |
| `EXLPY_FLASH_ATTN=0` | `flash_attn=False` | query blocks over the cache by gather + torch SDPA (no flash kernel) |
| `EXLPY_FLASH_TMA=1` | `flash_tma=True` | the flash kernel copies interior K/V tiles with TMA (Hopper) |
| `EXLPY_FLASH_CONFIG=BM,BN,warps,stages` | `flash_config` | override the flash kernel's prefill launch table |
| `EXLPY_API_KEY=KEY` | `api_key` | `exlpy serve`: one more API key clients may send (with `--api-key`) |
| `EXLPY_QUANT_ROWS=N` | `quant_rows` | 2-N rows (0-64, default 64; 0: off) run the multi-row quant matmul |
| `EXLPY_GEMV_ROWS=N` | `gemv_rows` | 2-N rows (0-8; default 4) of a quant matmul run the decode GEMV (FMAs per row) |
| `EXLPY_GPTQ_KERNEL=1` | `gptq_kernel=True` | the converter's GPTQ blocks through the Triton kernel |
| `EXLPY_QMM_KERNEL=K` | `qmm_kernel` | 2-64 rows: `qmm` (default), `tc` (tensor-core GEMM) or `auto` |
| `EXLPY_TC_MAX_ROWS=N` | `tc_max_rows` | 65-N rows (N 64-256; 64: off) run exl2_tc, not dequantize + cuBLAS |
| `EXLPY_GRAPH_SAMPLING=0` | `graph_sampling` | the generators sample on the host chain, not in a captured graph |
| `EXLPY_PREFILL_GRAPHS=0` | `prefill_graphs=False` | prompt chunks next to decoding jobs run eagerly, not captured |
| `EXLPY_MIXED_STEP=1` | `mixed_step=True` | prompt chunks next to decoding jobs run inside the decode step (eager) |
| `EXLPY_COMBINED_PREFILL=0` | `combined_prefill=False` | several prompts' chunks: a pass each, not shared passes |
| `EXLPY_MOE_GEMV=0` | `moe_gemv=False` | EXL2 experts at decode: tile kernels, not the split-K GEMV / multi-row ones |
| `EXLPY_MOE_ROWS=0` | `moe_rows=False` | EXL2 experts at 3-16 rows each (batched decode): tile kernels, no multi-row |
| `TRITON_INTERPRET=1` | `triton_interpret` | (Triton's own) kernels interpreted on the CPU; no PDL then |
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from exlpy.errors import ConfigError

TP_COMMS = ("auto", "local", "host", "nccl", "peer", "hostmem")
TP_LAYOUTS = ("auto", "row", "column")
TP_PREFILL_COMMS = ("default", "copy")
QMM_KERNELS = ("auto", "qmm", "tc")


@dataclass(frozen=True)
class RuntimeOptions:
    no_graphs: bool = False
    no_flash_attn: bool = False
    no_xformers: bool = False
    no_sdpa: bool = False
    triton: bool = True
    pdl: bool = True
    tp_comm: str = "auto"
    tp_layout: str = "auto"
    tp_graphs: bool = True
    # Off: on two H100s the two micro-batches were host-bound (31.3 vs 26.4 ms plain for 2,048 tokens of a 70B-shaped
    # model; benchmarks/results/multigpu.md, 2026-11-26 22:54). benchmarks/tp.py times both.
    tp_pipeline: bool = False
    # EXLPY_TP_PREFILL_COMM=copy: on two GPUs, all-reduces of prefill-sized messages (exlpy/parallel/tp_copy.py
    # MIN_BYTES and up, outside graph capture) by a peer copy each way on the copy engines and one pass adding the
    # peer's partial (and norming the sum for the next block), instead of the decode backend (NCCL at those sizes);
    # with EXLPY_TP_PIPELINE=1 the copies are meant to overlap the other micro-batch's compute without taking SMs.
    # Opt-in: on two H100s its prefill was no faster (27.0 vs 26.4 ms plain; its host time per all-reduce ~390 us
    # more; benchmarks/results/multigpu.md, 2026-11-26 22:54).
    tp_prefill_comm: str = "default"
    # The next block's RMSNorm in the all-reduce where the backend fuses it (peer, hostmem). Off by default until
    # it has run on two real GPUs (written 2026-11-26; CPU interpreter tests and logits bit-equal there).
    tp_fuse_norm: bool = False
    # Prefill-sized row-parallel closing projections (o_proj, down_proj) run in this many row chunks; chunk i's
    # all-reduce runs on a side stream beside chunk i+1's GEMM, so all but the last chunk's collective leaves the
    # critical path. Unlike the micro-batch pipeline it adds only a few launches per projection (that one was
    # host-bound). 1: one GEMM then one all-reduce. Default chosen on two H100s by benchmarks/tp.py (multigpu.md).
    tp_overlap_chunks: int = 2
    cpu_warning: bool = True
    weight_checks: bool = True  # EXLPY_SKIP_WEIGHT_CHECKS=1: no NaN/inf check of weights at load
    triton_interpret: bool = False  # Triton's own TRITON_INTERPRET (kernels run on CPU tensors): no PDL then
    flash_attn: bool = True
    flash_tma: bool = False
    flash_config: tuple[int, int, int, int] | None = None
    api_key: str | None = field(default=None, repr=False)  # EXLPY_API_KEY: a key for `exlpy serve`
    # EXLPY_QUANT_ROWS: 2 up to this many rows of an EXL2/GPTQ matmul run exl2_qmm (packed weights read once);
    # 0 turns it off (dequantize + cuBLAS). Default 64: its GPU tests pass (H100 x2, 2026-11-26 09:40) and it
    # beats dequantize + cuBLAS at every row count up to 64 on the 8B shapes (benchmarks/results/exl2_speed.md).
    quant_rows: int = 64
    # EXLPY_GEMV_ROWS: 2 up to this many rows take the decode GEMV extended to several rows (exl2_gemv.py), which
    # beats the tensor-core kernel where the rows' FMAs cost less than that kernel's fixed cost; 0 or 1: off.
    gemv_rows: int = 4
    # EXLPY_QMM_KERNEL: which kernel multiplies the 2-64 rows that reach the multi-row path (EXLPY_QUANT_ROWS,
    # past EXLPY_GEMV_ROWS) by packed weights: qmm (exl2_qmm.py), tc (exl2_tc.py, the tensor-core dequant GEMM)
    # or auto (tc where its launch table, exl2_tc_plan.TC_ROWS, says it was measured faster: 5-32 rows on an H100;
    # qmm elsewhere). qmm by default: exl2_tc's code changed after its GPU run (a shared split-K workspace, a
    # per-task group offset) and has not run on a GPU since; auto once it has.
    qmm_kernel: str = "qmm"
    # EXLPY_TC_MAX_ROWS: 65 up to this many rows of an EXL2/GPTQ matmul (prompt chunks of up to 256 tokens) run the
    # tensor-core dequant GEMM (exl2_tc.py, packed weights decoded in registers) instead of dequantizing every weight
    # to an fp16 scratch matrix for cuBLAS, below a shape's exl2_qmm_plan.CROSSOVER; independent of
    # EXLPY_QMM_KERNEL, which picks the kernel of 2-64 rows. 64 (the default) keeps it off: its 65-256-row classes
    # passed the CPU interpreter tests only and have not been timed against dequantize + cuBLAS on a GPU
    # (benchmarks/exl2_speed.py --parts wide does both).
    tc_max_rows: int = 64
    # EXLPY_GPTQ_KERNEL=1: the converter's GPTQ rows through the Triton kernel (kernels/gptq_block.py), one launch per
    # block, instead of its torch reference; opt-in until it has run on a GPU.
    gptq_kernel: bool = False
    # EXLPY_GRAPH_SAMPLING=0 turns off the captured sampler (generator/sampling/graphed.py), on by default where
    # decode steps are CUDA graphs: its GPU tests pass (H100, 2026-11-26 12:17) and it holds exllamav2's default
    # Settings() at 99% of greedy at batch 1 against 55% for the host chain (benchmarks/results/decode_step.md);
    # `generator.graph_sampling = False` turns it off for one generator.
    graph_sampling: bool = True
    # The dynamic generator runs prompt chunks next to decoding jobs as captured chunks of 32-256 tokens
    # (exlpy/engine/graphs.py CHUNK_BUCKETS) instead of eager forward passes (~20 ms of kernel launches from Python
    # per chunk on an 8B, which the next decode step waits for). On an H100 (2026-11-26 21:23; 8B, 32 decoders, a
    # 16k prompt arriving) the decoders' inter-token p99 was 20.1 ms against 8.4 ms alone (2.40x), TTFT 2.0 s, and the
    # generator and server tests passed with it on (83 passed, 21:31). EXLPY_PREFILL_GRAPHS=0: eager chunks.
    prefill_graphs: bool = True
    # EXLPY_MIXED_STEP=1: the dynamic generator runs prompt chunks next to decoding jobs inside the decode step: one
    # eager pass over the decode rows and the chunks' tokens (model/batch.py mixed_batch), the weights read once per
    # iteration instead of twice. Same tokens either way (tests/test_mixed_step.py). Opt-in: on an H100 (8B, 32
    # decoders, a 16k prompt; 2026-11-26 21:23) the eager pass cost the generator thread 37 ms of kernel launches
    # per iteration, gaps 41.1 ms against 18.7 ms with the captured step + captured chunk: it pays only once the
    # mixed pass itself is captured (graphs per decode bucket and chunk size).
    mixed_step: bool = False
    # The dynamic generator runs the prompt chunks of two or more sequences in one iteration as shared eager passes
    # (model/batch.py mixed_batch: their tokens end to end, attention per chunk), at most max_chunk_size tokens a
    # pass, instead of a pass each (or captured pieces of <= 256 tokens each next to decoding jobs): without decoding
    # jobs always, next to them once the iteration's budget exceeds CAPTURED_MAX (scheduler.combines_prompts; a lone
    # prompt keeps its captured pieces). On by default: each pass reads every weight, and an EXL2 pass above 64 rows
    # dequantizes them all first, so 64 arriving streams paid that once per chunk or piece (the EXL2 8B at 73% of its
    # generator, TTFT p50 3.58 s; benchmarks/results/serving.md 12:46); mixed_batch's prompt segments ran on an H100
    # in the mixed step's GPU test. Same tokens either way (tests/test_combined_prefill.py). EXLPY_COMBINED_PREFILL=0:
    # a pass each, as before.
    combined_prefill: bool = True
    # EXL2 expert stacks with few rows per expert (decode) run exlpy/kernels/moe_exl2_gemv.py's split-K GEMV kernels
    # instead of the tile kernels: Mixtral's EXL2 4.0 experts at batch 1 on an H100 went from 8.4% to 54.2% of the
    # bandwidth limit (2026-11-26; the MoE tests passed there with them on). EXLPY_MOE_GEMV=0 takes the tile kernels.
    moe_gemv: bool = True
    # 3-16 rows per expert (batched decode) run exlpy/kernels/moe_exl2_rows.py's multi-row kernels instead of the
    # tile kernels: Mixtral EXL2 4.0 at batch 32 on an H100 went from 3,722 to 6,589 tok/s (the experts from 14% to
    # 25% of the copy rate; 2026-11-26 20:21). EXLPY_MOE_ROWS=0 takes the tile kernels.
    moe_rows: bool = True

    def __post_init__(self) -> None:
        if self.tp_comm not in TP_COMMS:
            raise ConfigError(f"unknown TP collective backend '{self.tp_comm}' (EXLPY_TP_COMM): use one of "
                              f"{', '.join(TP_COMMS[1:])}")
        if self.tp_prefill_comm not in TP_PREFILL_COMMS:
            raise ConfigError(f"unknown TP prefill collective '{self.tp_prefill_comm}' (EXLPY_TP_PREFILL_COMM): use "
                              "default or copy")
        if not 1 <= self.tp_overlap_chunks <= 16:
            raise ConfigError(f"EXLPY_TP_OVERLAP={self.tp_overlap_chunks}: row chunks per TP prefill product, 1 to 16")
        if self.tp_layout not in TP_LAYOUTS:
            raise ConfigError(f"unknown TP layout '{self.tp_layout}' (EXLPY_TP_MODE): use row or column")
        if self.flash_config is not None and (len(self.flash_config) != 4 or min(self.flash_config) < 1):
            raise ConfigError(f"EXLPY_FLASH_CONFIG {self.flash_config}: four positive ints BM,BN,warps,stages")
        if not 0 <= self.gemv_rows <= 8:
            raise ConfigError(f"EXLPY_GEMV_ROWS={self.gemv_rows}: the decode GEMV takes 0 to 8 rows")
        if self.qmm_kernel not in QMM_KERNELS:
            raise ConfigError(f"EXLPY_QMM_KERNEL={self.qmm_kernel!r}: use one of {', '.join(QMM_KERNELS)}")
        if not 0 <= self.quant_rows <= 64:
            raise ConfigError(f"EXLPY_QUANT_ROWS={self.quant_rows}: the fused quantized matmul takes 0 to 64 rows")
        if not 64 <= self.tc_max_rows <= 256:
            raise ConfigError(f"EXLPY_TC_MAX_ROWS={self.tc_max_rows}: the tensor-core quantized matmul takes up to 64 "
                              "to 256 rows (64: none past the multi-row path's 64)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RuntimeOptions:
        e = os.environ if env is None else env

        def flag(name: str) -> bool:  # set and not "0" / empty
            return e.get(name, "") not in ("", "0")

        return cls(
            # exllamav2 tests presence only: EXLLAMA_NO_GRAPHS= (empty) still disables graphs there.
            no_graphs="EXLLAMA_NO_GRAPHS" in e,
            no_flash_attn="EXLLAMA_NO_FLASH_ATTN" in e,
            no_xformers="EXLLAMA_NO_XFORMERS" in e,
            no_sdpa="EXLLAMA_NO_SDPA" in e,
            triton=not flag("EXLPY_NO_TRITON"),
            pdl=e.get("EXLPY_PDL", "1") != "0",
            tp_comm=e.get("EXLPY_TP_COMM") or "auto",
            tp_layout=e.get("EXLPY_TP_MODE") or "auto",
            tp_graphs=not flag("EXLPY_TP_NO_GRAPHS"),
            tp_pipeline=flag("EXLPY_TP_PIPELINE"),
            tp_prefill_comm=e.get("EXLPY_TP_PREFILL_COMM") or "default",
            tp_fuse_norm=flag("EXLPY_TP_FUSE_NORM"),
            tp_overlap_chunks=(_ints(e.get("EXLPY_TP_OVERLAP", ""), "EXLPY_TP_OVERLAP") or (2,))[0],
            cpu_warning=not flag("EXLPY_NO_CPU_WARNING"),
            weight_checks=not flag("EXLPY_SKIP_WEIGHT_CHECKS"),
            triton_interpret=flag("TRITON_INTERPRET"),
            flash_attn=e.get("EXLPY_FLASH_ATTN", "1") != "0",
            flash_tma=flag("EXLPY_FLASH_TMA"),
            flash_config=_ints(e.get("EXLPY_FLASH_CONFIG", ""), "EXLPY_FLASH_CONFIG"),
            api_key=e.get("EXLPY_API_KEY") or None,
            quant_rows=(_ints(e.get("EXLPY_QUANT_ROWS", ""), "EXLPY_QUANT_ROWS") or (64,))[0],
            gemv_rows=(_ints(e.get("EXLPY_GEMV_ROWS", ""), "EXLPY_GEMV_ROWS") or (4,))[0],
            qmm_kernel=e.get("EXLPY_QMM_KERNEL") or "qmm",
            tc_max_rows=(_ints(e.get("EXLPY_TC_MAX_ROWS", ""), "EXLPY_TC_MAX_ROWS") or (64,))[0],
            gptq_kernel=flag("EXLPY_GPTQ_KERNEL"),
            graph_sampling=e.get("EXLPY_GRAPH_SAMPLING", "1") != "0",
            prefill_graphs=e.get("EXLPY_PREFILL_GRAPHS", "1") != "0",
            mixed_step=flag("EXLPY_MIXED_STEP"),
            combined_prefill=e.get("EXLPY_COMBINED_PREFILL", "1") != "0",
            moe_gemv=e.get("EXLPY_MOE_GEMV", "1") != "0",
            moe_rows=e.get("EXLPY_MOE_ROWS", "1") != "0",
        )


def _ints(text: str, name: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in text.split(",")) if text.strip() else None
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected comma-separated integers") from None


_current: RuntimeOptions | None = None


def options() -> RuntimeOptions:
    """The process's options: the environment as it was at the first call (or what `use_options` set)."""
    global _current
    if _current is None:
        _current = RuntimeOptions.from_env()
    return _current


@contextlib.contextmanager
def use_options(opts: RuntimeOptions) -> Iterator[RuntimeOptions]:
    """Run a block under other options (tests and benchmarks that compare variants)."""
    global _current
    before = options()
    _current = opts
    try:
        yield opts
    finally:
        _current = before
