"""The tensor-parallel benchmark's TP runs: one loaded TP model checked against the one-GPU logits, decode (CUDA
graphs, eager, device-fed, batched), prefill plain, pipelined and (two GPUs) with the copy collective, the
fused-norm A/B, diagnostics, the same model reloaded with each other collective backend, and memory over a long
decode."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.tp_diag import sync_check, top_kernels
from benchmarks.tp_parts.collectives import host_mem_comm_ok, peer_comm_ok
from benchmarks.tp_parts.timing import decode_fed_ms, decode_ms, mem, prefill_ms, prefill_times, profile_steps, sync_all
from exlpy import ExLlamaV2, ExLlamaV2Config
from exlpy.cache.tp import ExLlamaV2Cache_TP
from exlpy.engine.tensor_parallel import link_next_norms
from exlpy.model.parallel_linear import RowParallel
from exlpy.parallel.tp_comm import nccl_usable
from exlpy.parallel.tp_copy import CopyAllReduce
from exlpy.runtime import RuntimeOptions


def ctx_devs(ctx) -> list[torch.device]:  # noqa: ANN001
    return [ctx.all_devs[s] for s in ctx.all_devices()]


@dataclass
class TPBench:
    """What every TP run reads: the options, the results (written as it goes, `save` writes them out), the GPU
    count, the model directory, the inputs and the one-GPU reference logits."""

    args: argparse.Namespace
    res: dict
    n: int
    path: Path
    prompt: torch.Tensor
    long_ids: torch.Tensor
    ref: torch.Tensor
    save: Callable[[], None]

    def load(self, split: list[float] | None, opts: RuntimeOptions | None = None) -> ExLlamaV2:
        cfg2 = ExLlamaV2Config(str(self.path))
        cfg2.max_seq_len, cfg2.max_input_len, cfg2.max_attention_size = 4096, 2048, 2048**2
        m = ExLlamaV2(cfg2)
        m.load_tp(split, expect_cache_tokens=4096, options=opts)
        return m

    def diag(self, m: ExLlamaV2, c: ExLlamaV2Cache_TP, out: dict) -> None:
        """Per-stage timing of prefill (eager loop) and graph decode, host syncs, top kernels."""
        prompt, long_ids, n = self.prompt, self.long_ids, self.n

        def prefill() -> None:
            c.current_seq_len = 0
            m.forward(long_ids, c, last_id_only=True)

        self.res["phase"] = "tp_diag"
        c.current_seq_len = 0
        m.forward(prompt, c, preprocess_only=True)
        tok = prompt[:, -1:]
        m.forward(tok, c)  # graphs captured

        def step() -> None:
            m.forward(tok, c)

        out["sync_check_prefill"] = sync_check(prefill, n)
        out["sync_check_decode"] = sync_check(step, n)
        out["prefill_top_kernels"] = top_kernels(prefill, n)

    def run(self, split: list[float] | None, tag: str, full: bool, opts: RuntimeOptions | None = None) -> None:
        """One TP run into res[tag] (full: also eager decode, profiles, diagnostics, the other backends and the
        memory run)."""
        args, res, n, prompt, long_ids = self.args, self.res, self.n, self.prompt, self.long_ids
        res["phase"] = tag
        m = self.load(split, opts)
        ctx = m.tp_context
        closer = m.strategy.stages[0].lanes[0].modules[1].o_proj
        out = {"kv_split": ctx.kv_split, "id_split": ctx.id_split, "vc_split": ctx.vc_split,
               "comm": ctx.comm.name, "mode": "row" if isinstance(closer, RowParallel) else "column",
               "graphs": m.strategy.graph_safe}
        res[tag] = out  # filled in as it goes: a watchdog exit still saves the partial figures
        tp_logits = m.forward(prompt[:, :64]).float()
        out["max_abs_diff"] = round((tp_logits.cpu() - self.ref.cpu()).abs().max().item(), 4)
        out["ref_absmax"] = round(self.ref.abs().max().item(), 3)
        out["argmax_agree"] = float((tp_logits.argmax(-1).cpu() == self.ref.argmax(-1).cpu()).float().mean())
        c = ExLlamaV2Cache_TP(m, max_seq_len=4096)
        self._decode(m, c, out, full)
        total, host = prefill_times(m, c, long_ids, n)
        out["prefill2048_ms"], out["prefill2048_host_ms"] = round(total, 2), round(host, 2)
        out["overlap_chunks"] = m.strategy.stages[0].group.overlap_chunks
        self._overlap_chunks(m, c, out)
        self._pipelined_prefill(m, c, out)
        out["decode_fed_ms"] = round(decode_fed_ms(m, c, prompt, args.steps, n), 3)
        if args.profile and full:
            out["b1_kernels"] = profile_steps(m, c, prompt, n)
        if args.batch:
            self._batched(m, out, full)
        out["comm_timings_us"] = {k: round(v * 1e6, 1) for k, v in (ctx.comm.timings or {}).items()}
        print(json.dumps({tag: out}), flush=True)
        self.save()
        if full and not args.no_diag:
            try:
                self.diag(m, c, out)
            except Exception:  # noqa: BLE001 - diagnostics must not cost the speed figures
                out["diag_error"] = traceback.format_exc()[-1500:]
            print(json.dumps({tag: out}), flush=True)
            self.save()
            res["phase"] = tag
        if full:
            # A/B in the same process: the same model reloaded with each other backend that works here (the
            # old default NCCL against the host-memory / peer kernels), decode b1 and batched, and prefill.
            default = ctx.comm.name
            devs = ctx_devs(ctx)
            others = [x for x, ok in (("nccl", nccl_usable(devs)), ("hostmem", host_mem_comm_ok(devs)),
                                      ("peer", peer_comm_ok(devs))) if ok and x != default]
            others += ["local", "host"] if args.all_comms else []
            for name in others:
                m2 = None
                try:
                    del c  # the model's memory goes before the other backend's copy loads
                    m.unload()
                    m2 = self.load(split, RuntimeOptions(tp_comm=name))
                    self._other_backend(m2, name, out)
                    print(json.dumps({tag: out}), flush=True)
                    self.save()
                finally:
                    if m2 is not None:
                        m2.unload()
                m = self.load(split, opts)
                c = ExLlamaV2Cache_TP(m, max_seq_len=4096)
            if args.mem_steps:
                self._memory(m, c, out)
        res[tag] = out
        print(json.dumps({tag: out}), flush=True)
        self.save()
        del c
        m.unload()
        torch.cuda.empty_cache()

    def _decode(self, m: ExLlamaV2, c: ExLlamaV2Cache_TP, out: dict, full: bool) -> None:
        """Decode b1 through CUDA graphs (eager when capture fails, recorded), graph against eager logits of one
        step, and with `full` eager decode timed."""
        args, n, prompt = self.args, self.n, self.prompt
        try:
            out["decode_ms_graphs"] = round(decode_ms(m, c, prompt, args.steps, n), 3)
        except Exception:  # noqa: BLE001 - record and go on with eager decode
            out["graph_error"] = traceback.format_exc()[-1500:]
            print(out["graph_error"], flush=True)
            m.config.no_graphs = True
            out["decode_ms_graphs"] = round(decode_ms(m, c, prompt, args.steps, n), 3)
        # Graph decode equals eager decode (same cache state, same token).
        c.current_seq_len = 0
        m.forward(prompt, c, preprocess_only=True)
        tok = prompt[:, -1:]
        lg = m.forward(tok, c)
        c.current_seq_len -= 1
        no_graphs, m.config.no_graphs = m.config.no_graphs, True
        le = m.forward(tok, c)
        out["graph_vs_eager_maxdiff"] = round((lg - le).abs().max().item(), 4)
        if full:
            out["decode_ms_eager"] = round(decode_ms(m, c, prompt, args.steps // 2, n), 3)
        m.config.no_graphs = no_graphs

    def _overlap_chunks(self, m: ExLlamaV2, c: ExLlamaV2Cache_TP, out: dict) -> None:
        """Prefill 2048 with the closing projections in 1, 2, 3 and 4 row chunks (EXLPY_TP_OVERLAP: each chunk's
        all-reduce on a side stream beside the next chunk's GEMM), twice each, interleaved (the one-GPU baseline
        moved by 6% between runs); the last position's logits of each against one chunk."""
        group = m.strategy.stages[0].group
        keep = group.overlap_chunks
        try:
            group.overlap_chunks = 1
            c.current_seq_len = 0
            whole = m.forward(self.long_ids, c, last_id_only=True).float()
            for rnd in range(2):
                for chunks in (1, 2, 3, 4):
                    group.overlap_chunks = chunks
                    total, host = prefill_times(m, c, self.long_ids, self.n)
                    key = f"prefill2048_ms_overlap{chunks}"
                    out[key] = round(min(total, out.get(key, 1e9)), 2)
                    out[f"prefill2048_host_ms_overlap{chunks}"] = round(host, 2)
                    if rnd == 0 and chunks > 1:
                        c.current_seq_len = 0
                        last = m.forward(self.long_ids, c, last_id_only=True).float()
                        out[f"overlap{chunks}_vs_whole_maxdiff"] = round((last - whole).abs().max().item(), 4)
            print("OVERLAP_CHUNKS " + json.dumps({k: v for k, v in out.items() if "overlap" in k}), flush=True)
        except Exception:  # noqa: BLE001 - record and go on
            out["overlap_error"] = traceback.format_exc()[-1500:]
            print(out["overlap_error"], flush=True)
        finally:
            group.overlap_chunks = keep

    def _pipelined_prefill(self, m: ExLlamaV2, c: ExLlamaV2Cache_TP, out: dict) -> None:
        """A/B of the prefill's collectives on the same model: one chunk with the decode backend (timed above),
        two overlapped micro-batches (EXLPY_TP_PIPELINE), and on two GPUs the copy collective
        (EXLPY_TP_PREFILL_COMM=copy: peer copies on the copy engines, then one pass adding the peer's partial and
        norming the sum for the next block) alone and with the micro-batches, and that last way with a plain add
        before a separate norm ("_unfused"); the last position's logits of each against the plain way (they differ
        only by summation order)."""
        long_ids, n = self.long_ids, self.n
        group = m.strategy.stages[0].group
        overlap, prefill = m.strategy.overlap_prefill, group.prefill
        closers = [cl for lane in m.strategy.stages[0].lanes for mod in lane.modules
                   for cl in (getattr(mod, "o_proj", None), getattr(mod, "down_proj", None))
                   if isinstance(cl, RowParallel)]
        links = [cl.prefill_norm for cl in closers]
        variants: list[tuple[str, bool, object, bool]] = [("pipelined", True, prefill, True)]
        if n == 2:
            try:
                copy = prefill if isinstance(prefill, CopyAllReduce) else CopyAllReduce(ctx_devs(m.tp_context))
                variants += [("copy", False, copy, True), ("pipelined_copy", True, copy, True),
                             ("pipelined_copy_unfused", True, copy, False)]
            except Exception:  # noqa: BLE001 - record and go on
                out["copy_error"] = traceback.format_exc()[-1500:]

        def fuse_norms(on: bool) -> None:  # the copy collective's last pass norms the sum (load_tp links them)
            for lane in m.strategy.stages[0].lanes:
                link_next_norms(lane.modules, m.config.spec, "prefill_norm")
            if not on:
                for cl in closers:
                    cl.prefill_norm = None

        try:
            c.current_seq_len = 0
            m.strategy.overlap_prefill, group.prefill = False, prefill
            plain_last = m.forward(long_ids, c, last_id_only=True).float()
            if getattr(self.args, "prefill_kernels", False):
                out["prefill_top_kernels_plain"] = top_kernels(lambda: self._prefill_once(m, c), n, rows=16)
            for name, piped, comm, fused in variants:
                m.strategy.overlap_prefill, group.prefill = piped, comm
                fuse_norms(fused)
                total, host = prefill_times(m, c, long_ids, n)
                out[f"prefill2048_ms_{name}"], out[f"prefill2048_host_ms_{name}"] = round(total, 2), round(host, 2)
                c.current_seq_len = 0
                last = m.forward(long_ids, c, last_id_only=True).float()
                out[f"{name}_vs_plain_maxdiff"] = round((last - plain_last).abs().max().item(), 4)
                if getattr(self.args, "prefill_kernels", False):
                    out[f"prefill_top_kernels_{name}"] = top_kernels(lambda: self._prefill_once(m, c), n, rows=16)
        except Exception:  # noqa: BLE001 - record and go on
            out["pipeline_error"] = traceback.format_exc()[-1500:]
            print(out["pipeline_error"], flush=True)
        finally:
            m.strategy.overlap_prefill, group.prefill = overlap, prefill
            for cl, link in zip(closers, links):
                cl.prefill_norm = link

    def _prefill_once(self, m: ExLlamaV2, c: ExLlamaV2Cache_TP) -> None:
        c.current_seq_len = 0
        m.forward(self.long_ids, c, last_id_only=True)

    def _batched(self, m: ExLlamaV2, out: dict, full: bool) -> None:
        """Batched decode (read back and device-fed), and the A/B of the next norm fused into the all-reduce
        (host-memory backend): unlinked, graphs recaptured."""
        args, n, prompt = self.args, self.n, self.prompt
        cb = ExLlamaV2Cache_TP(m, batch_size=args.batch, max_seq_len=512)
        out[f"decode_b{args.batch}_ms"] = round(decode_ms(m, cb, prompt.repeat(args.batch, 1), args.steps // 2,
                                                          n), 3)
        out[f"decode_fed_b{args.batch}_ms"] = round(decode_fed_ms(m, cb, prompt.repeat(args.batch, 1),
                                                                  args.steps // 2, n), 3)
        if args.profile and full:
            out[f"b{args.batch}_kernels"] = profile_steps(m, cb, prompt.repeat(args.batch, 1), n)
        del cb
        closers = [cl for lane in m.strategy.stages[0].lanes for mod in lane.modules
                   for cl in (getattr(mod, "o_proj", None), getattr(mod, "down_proj", None))
                   if isinstance(cl, RowParallel) and cl.next_norm is not None]
        out["fused_norm_closers"] = len(closers)
        if closers:
            links = [c.next_norm for c in closers]
            for cl in closers:
                cl.next_norm = None
            try:
                cb = ExLlamaV2Cache_TP(m, batch_size=args.batch, max_seq_len=512)
                out[f"decode_b{args.batch}_ms_unfused_norm"] = round(
                    decode_ms(m, cb, prompt.repeat(args.batch, 1), args.steps // 4, n), 3)
                del cb
            finally:
                for cl, link in zip(closers, links):
                    cl.next_norm = link

    def _other_backend(self, m2: ExLlamaV2, name: str, out: dict) -> None:
        """Decode b1 (read back and fed), prefill and batched decode of the model reloaded with backend `name`."""
        args, n, prompt = self.args, self.n, self.prompt
        c2 = ExLlamaV2Cache_TP(m2, max_seq_len=4096)
        out[f"decode_ms_{name}"] = round(decode_ms(m2, c2, prompt, args.steps // 2, n), 3)
        out[f"decode_fed_ms_{name}"] = round(decode_fed_ms(m2, c2, prompt, args.steps // 2, n), 3)
        out[f"prefill2048_ms_{name}"] = round(prefill_ms(m2, c2, self.long_ids, n), 2)
        del c2
        if args.batch:
            cb = ExLlamaV2Cache_TP(m2, batch_size=args.batch, max_seq_len=512)
            out[f"decode_b{args.batch}_ms_{name}"] = round(
                decode_ms(m2, cb, prompt.repeat(args.batch, 1), args.steps // 4, n), 3)
            del cb

    def _memory(self, m: ExLlamaV2, c: ExLlamaV2Cache_TP, out: dict) -> None:
        """Memory per GPU before and after --mem-steps decode steps (the cache wrapped inside itself)."""
        args, n, prompt = self.args, self.n, self.prompt
        c.current_seq_len = 0
        m.forward(prompt, c)
        tok = prompt[:, -1:]
        m.forward(tok, c)
        sync_all(n)
        for i in range(n):
            torch.cuda.reset_peak_memory_stats(i)
        start = mem(n)
        t0 = time.perf_counter()
        for _ in range(args.mem_steps):
            if c.current_seq_len >= 4000:
                c.current_seq_len = 128  # wrap inside the cache: the step itself is what is measured
            tok = m.forward(tok, c)[:, -1:].argmax(-1).cpu()
        sync_all(n)
        out["mem_steps"] = args.mem_steps
        out["mem_steps_s"] = round(time.perf_counter() - t0, 1)
        out["mem_start"], out["mem_end"] = start, mem(n)
