"""The sampler of a decode step as fixed-shape device work, captured in a CUDA graph per row bucket.

Rows whose settings fit (`graph_params.graph_capable`) are sampled here by the generators: repetition /
frequency / presence penalties (whole context, or a range with decay), blocked tokens, token bias, grammar
bitmasks, the vocabulary limit, temperature and smoothing, top-k, top-p, top-a, min-p, TFS, typical, dynamic or
last temperature, XTC, skew and the draw; other rows keep the host chain (exlpy/generator/sampler.py, which
stays the reference). Speculative verification runs on the same kernels (graph_verify.py). Nothing here reads
the device from the host, and no shape depends on the data, so on CUDA the whole chain is one graph replay per
step:

- Per-row parameters live in static device tensors of the row bucket (`_Bucket`), written by the host before
  each replay with one pinned, non-blocking copy per kind: changing settings never recaptures anything.
- Penalties read a token-count table `counts[slot, V]` (one slot per job, `bind_counts` fills it once from the
  context); the graph adds each sampled token to its row's slot, so the counts follow the sequence without the
  host. A penalty range (with decay) reads the slot's newest WINDOW tokens instead, shifted by the graph the
  same way. Token bias rows live in a table of the same shape, written when a job first uses its slot.
- The random point of a row is either drawn by the host (a seeded job's torch.Generator: the same numbers the
  host sampler draws, so seeded jobs stay reproducible across both paths) or by the kernel from Philox of the
  row's (seed, counter); the graph advances the counter, so a replay draws fresh numbers.
- top-k / top-p / top-a / min-p and the draw are `ops.sample_top` (exlpy/kernels/sample_top.py): the K_MAX most
  likely tokens per row without sorting the vocabulary. Rows without top-k (top-p alone, as the OpenAI server
  sends) may keep more than K_MAX tokens: the kernel finishes those over the whole vocabulary without a sort
  (kernels/sample_whole.py; same distribution, drawn in vocabulary order). Rows with K_MAX < top-k < vocabulary
  take the host chain.

Variants of the graph by the features the step's rows use (penalties, a penalty range, bias, masks, blocked
tokens, smoothing, the candidate steps, rows without top-k) are captured apart, so a plain step does not pay
for what it does not apply.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from exlpy.capture import gc_paused
from exlpy.engine.graphs import BUCKETS, bucket_for
from exlpy.generator.sampling import truncation
from exlpy.generator.sampling.draw import draw
from exlpy.generator.sampling.graph_params import (  # noqa: F401 - graph_capable, verify_capable: the API
    BLOCKED_LOGIT,
    K_MAX,
    NEXT,
    WINDOW,
    ext_params,
    graph_capable,
    has_penalties,
    row_params,
    verify_capable,
)
from exlpy.generator.sampling.settings import SamplerSettings
from exlpy.generator.sampling.temperature import apply_temperature, dynamic_temperature
from exlpy.generator.sampling.xtc import xtc
from exlpy.kernels import ops
from exlpy.kernels.sample_top import NPARAM


@dataclass
class GraphRow:
    """One row of a step: its settings, sampler slot (penalty counts, bias), random source and masks."""

    settings: SamplerSettings
    slot: int = -1  # -1: no slot (no penalties, no bias)
    seed: int = 0
    counter: int = 0  # Philox counter: the row's token index
    point: float | None = None  # host-drawn random point (None: Philox of (seed, counter))
    blocked: list[int] | None = None
    mask: torch.Tensor | None = None  # grammar bitmask [1, W] int32 on the host


@dataclass
class _Bucket:
    rows: int
    x: torch.Tensor  # [R, V] float32 logits in
    params: torch.Tensor  # [R, NPARAM] float32
    pen: torch.Tensor  # [R, 5] float32: repetition, frequency, presence, range (< 0: whole context), decay
    rng: torch.Tensor  # [R, 2] int64: seed, counter
    slots: torch.Tensor  # [R] int64 (padding / no slot: the spare slot)
    mask: torch.Tensor  # [R, W] int32 grammar bitmask (all ones: no mask)
    block: torch.Tensor  # [R, W] int32 blocked-token bits
    ext: torch.Tensor  # [R, NEXT] float32: candidate steps and smoothing (ext_params)
    tokens: torch.Tensor  # [R] int64 out
    probs: torch.Tensor  # [R] float32 out
    ok: torch.Tensor  # [R] bool out
    graphs: dict[tuple[bool, ...], Any]
    # What the device buffers hold (after this step's graph advanced the counters): unchanged values are not
    # uploaded again, so a steady batch costs the host no copies.
    held: dict[str, Any] = field(default_factory=dict)


class GraphSampler:
    """Samples rows of a decode step's logits [B, V] on their device (see the module docstring)."""

    def __init__(self, vocab: int, device: torch.device, slots: int, limit: int | None = None,
                 capture: bool | None = None, tokenizer: Any = None) -> None:
        self.vocab = vocab
        self.tokenizer = tokenizer  # XTC's default ignore set (the host chain's)
        self.device = torch.device(device)
        self.slots = slots  # slot `slots` is the spare one that padding rows and slot-less rows use
        self.limit = limit if limit is not None and limit < vocab else None  # tokenizer's vocabulary size
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.words = (vocab + 31) // 32
        self.counts: torch.Tensor | None = None
        self.window: torch.Tensor | None = None  # [slots + 1, WINDOW] int64, oldest first, -1 = none
        self._age = torch.arange(WINDOW - 1, -1, -1, device=self.device, dtype=torch.float32)  # 0 = newest
        self.bias: torch.Tensor | None = None
        self.bias_of: dict[int, int] = {}  # slot -> id of the bias tensor written there (while it lives)
        self.biased: set[int] = set()  # slots whose bias row holds a bias
        self.buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self._word = torch.arange(vocab, device=self.device) // 32
        self._bit = (torch.arange(vocab, device=self.device) % 32).to(torch.int32)
        self.steps = 0
        self._verifier: Any = None  # graph_verify.Verifier, made on first use
        self.failed = False  # a step failed (e.g. a capture the driver refused): the generators stop using it

    # --- per-job state -------------------------------------------------------------------------------------
    def _table(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            t = torch.zeros(self.slots + 1, self.vocab, dtype=torch.float32, device=self.device)
            setattr(self, name, t)
            if name == "counts":  # with the counts, the newest WINDOW tokens (penalties with a range)
                self.window = torch.full((self.slots + 1, WINDOW), -1, dtype=torch.int64, device=self.device)
            for b in self.buckets.values():
                b.graphs.clear()  # captured graphs do not read a table allocated after them
        return t

    def bind_counts(self, slot: int, ids: torch.Tensor) -> None:
        """Counts of `slot` := occurrences of each token in `ids` (the whole context; ids outside V ignored), and
        its window := the newest WINDOW of them."""
        counts = self._table("counts")
        ids = ids.reshape(-1).long().to(self.device, non_blocking=True)
        inside = ((ids >= 0) & (ids < self.vocab)).float()  # a weight, not a mask: no host sync on a device
        row = torch.zeros(self.vocab, dtype=torch.float32, device=self.device)
        row.index_add_(0, ids.clamp(0, self.vocab - 1), inside)
        counts[slot].copy_(row)
        assert self.window is not None
        tail = ids[-WINDOW:]
        self.window[slot].fill_(-1)
        self.window[slot, WINDOW - tail.numel():].copy_(tail)

    def bind_bias(self, slot: int, bias: torch.Tensor | None) -> None:
        """Bias row of `slot` := bias[:V] (zeros past a shorter bias), rewritten only when the tensor changes."""
        if bias is None:
            if self.bias is not None and slot in self.biased:
                self.bias[slot].zero_()
                self.biased.discard(slot)
                self.bias_of.pop(slot, None)
            return
        if self.bias_of.get(slot) == id(bias):
            return
        table = self._table("bias")
        self.biased.add(slot)  # its row is not zero (until a slot-less or bias-less row zeroes it)
        row = torch.zeros(self.vocab, dtype=torch.float32)
        n = min(bias.numel(), self.vocab)
        row[:n] = bias.reshape(-1)[:n].float().cpu()
        table[slot].copy_(row.to(self.device, non_blocking=True))
        self.bias_of[slot] = id(bias)
        # a later tensor may reuse the id of a freed one: forget the id when its tensor goes
        weakref.finalize(bias, _forget, self.bias_of, slot, id(bias))

    # --- speculative verification ---------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, drafts: torch.Tensor, settings: list[SamplerSettings],
               u: list[list[float]], r: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rejection rule over logits [B, T, V] of rows whose settings are `verify_capable`, drafts [B, T-1]
        (device), acceptance points u[b][i] and draw points r[b][t] (host floats, drawn from the jobs'
        generators as `verify_rows` takes them). Returns (accepted drafts [B], the token the target adds [B]),
        equal to `speculative.verify.verify_rows`; views of static buffers valid until the next call."""
        if self._verifier is None:
            from exlpy.generator.sampling.graph_verify import Verifier

            self._verifier = Verifier(self)
        try:
            with _on(self.device):
                return self._verifier.run(logits, drafts, settings, u, r)
        except Exception:
            if self.capture:
                self._pool = None
                self.failed = True
            raise

    # --- a step --------------------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[GraphRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample row i of `logits` [B, V] with rows[i]. Returns (tokens [B] int64, probabilities [B] float32,
        usable [B] bool) on the device, views of static buffers valid until the next call: copy what you keep."""
        n = len(rows)
        size = bucket_for(n)
        if size is None:
            size = max(n, BUCKETS[-1])
        b = self.buckets.get(size)
        if b is None:
            b = self.buckets[size] = self._bucket(size)
        try:
            with _on(self.device):
                return self._sample(b, n, logits, rows)
        except Exception:
            b.held.clear()  # the buffers may hold part of this step: upload everything next time
            if self.capture:
                # A failed capture can leave its pool marked as recording: later captures take a fresh one. The
                # callers stop using this sampler (`failed`) and sample the old way.
                self._pool = None
                self.failed = True
            raise

    def _sample(self, b: _Bucket, n: int, logits: torch.Tensor, rows: list[GraphRow]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feats = self._write(b, rows)
        b.x[:n].copy_(logits.float())
        if not self.capture:
            self._step(b, feats)
        else:
            g = b.graphs.get(feats)
            if g is None:
                g = b.graphs[feats] = self._capture(b, feats)  # its warm-up ran this step already
            else:
                g.replay()
        self.steps += 1
        return b.tokens[:n], b.probs[:n], b.ok[:n]

    def _bucket(self, rows: int) -> _Bucket:
        d = self.device
        return _Bucket(rows, torch.zeros(rows, self.vocab, device=d), torch.ones(rows, NPARAM, device=d),
                       torch.ones(rows, 5, device=d), torch.zeros(rows, 2, dtype=torch.int64, device=d),
                       torch.full((rows,), self.slots, dtype=torch.int64, device=d),
                       torch.full((rows, self.words), -1, dtype=torch.int32, device=d),
                       torch.zeros(rows, self.words, dtype=torch.int32, device=d),
                       torch.zeros(rows, NEXT, device=d), torch.zeros(rows, dtype=torch.int64, device=d),
                       torch.zeros(rows, device=d), torch.zeros(rows, dtype=torch.bool, device=d), {})

    def _write(self, b: _Bucket, rows: list[GraphRow]) -> tuple[bool, ...]:
        """Fill the bucket's parameter buffers for `rows` (padding rows: greedy, spare slot, no masks)."""
        pad = b.rows - len(rows)
        floats: list[float] = []
        pens: list[float] = []
        ints: list[int] = []
        slots: list[int] = []
        pen = bias = ranged = False
        for r in rows:
            s = r.settings
            floats += row_params(s, self.vocab, r.point)
            p = has_penalties(s) and r.slot >= 0
            pen |= p
            windowed = p and s.token_repetition_range >= 0
            ranged |= windowed
            pens += [float(s.token_repetition_penalty), float(s.token_frequency_penalty),
                     float(s.token_presence_penalty), float(s.token_repetition_range) if windowed else -1.0,
                     float(s.token_repetition_decay)] if p else [1.0, 0.0, 0.0, -1.0, 0.0]
            if r.slot >= 0:
                self.bind_bias(r.slot, s.token_bias)  # a no-op unless the slot's bias changed
                bias |= s.token_bias is not None
            ints += [r.seed & 0x7FFFFFFFFFFFFFFF, r.counter]
            slots.append(r.slot if r.slot >= 0 else self.slots)
        floats += [1.0, 1.0, 2.0, 0.0, 0.0, 1.0, 0.0] * pad
        pens += [1.0, 0.0, 0.0, -1.0, 0.0] * pad
        ints += [0, 0] * pad
        slots += [self.slots] * pad
        if b.held.get("params") != floats:
            upload(torch.tensor(floats, dtype=torch.float32), b.params.view(-1))
            b.held["params"] = floats
        ints += slots
        if b.held.get("ints") != ints:
            upload(torch.tensor(ints, dtype=torch.int64), None, (b.rng.view(-1), b.slots))
        ints[1:2 * b.rows:2] = [c + 1 for c in ints[1:2 * b.rows:2]]  # the step advances every counter
        b.held["ints"] = ints
        if pen and b.held.get("pen") != pens:
            upload(torch.tensor(pens, dtype=torch.float32), b.pen.view(-1))
            b.held["pen"] = pens
        exts = [ext_params(r.settings) for r in rows]
        cand = any(e[0] or e[2] or e[4] or e[8] or e[10] for e in exts)
        smooth = any(e[13] > 0.0 for e in exts)
        if cand or smooth:
            flat_ext = [v for e in exts for v in e] + [0.0] * (NEXT * pad)
            if b.held.get("ext") != flat_ext:
                upload(torch.tensor(flat_ext, dtype=torch.float32), b.ext.view(-1))
                b.held["ext"] = flat_ext
        masked = any(r.mask is not None for r in rows)
        blocked = any(r.blocked for r in rows)
        if masked:
            m = torch.full((b.rows, self.words), -1, dtype=torch.int32)
            for i, r in enumerate(rows):
                if r.mask is not None:
                    src = r.mask.reshape(-1).to(torch.int32)
                    w = min(src.numel(), self.words)
                    m[i, :w] = src[:w]
                    m[i, w:] = 0  # tokens past the mask's width are excluded (as ops.apply_token_bitmask)
            upload(m, b.mask)
        blocked_now = [(i, tuple(r.blocked)) for i, r in enumerate(rows) if r.blocked]
        if blocked and b.held.get("blocked") != blocked_now:
            b.held["blocked"] = blocked_now
            bl = torch.zeros(b.rows, self.words, dtype=torch.int64)
            for i, r in enumerate(rows):
                for t in r.blocked or ():
                    if 0 <= t < self.vocab:
                        bl[i, t // 32] |= 1 << (t % 32)
            upload(torch.where(bl >= 2**31, bl - 2**32, bl).to(torch.int32), b.block)
        # rows without top-k (and not greedy): their survivors may pass the fused kernel's candidates
        full = self.vocab > K_MAX and any(floats[i + 1] >= self.vocab for i in range(0, NPARAM * len(rows), NPARAM))
        return (pen, ranged, bias, masked, blocked, smooth, cand, full)

    def _step(self, b: _Bucket, feats: tuple[bool, ...]) -> None:
        """The captured work: logit stage, fused truncation + draw, count and counter updates."""
        pen, ranged, bias, masked, blocked, smooth, cand, full = feats
        x = b.x
        ok_in = torch.isfinite(x.amax(-1))
        x = torch.where(ok_in[:, None], x, torch.zeros_like(x))
        if pen:
            assert self.counts is not None
            c = self.counts.index_select(0, b.slots)  # the whole context: every occurrence weighs 1
            wmax, wsum = (c > 0).float(), c
            if ranged:
                wmax, wsum = self._windowed(b, wmax, wsum)
            r = 1.0 + (b.pen[:, 0:1] - 1.0) * wmax
            x = torch.where(x > 0, x / r, x * r) - b.pen[:, 2:3] * wmax - b.pen[:, 1:2] * wsum
        if blocked:
            hit = ((b.block.index_select(1, self._word) >> self._bit) & 1).bool()
            x = x.masked_fill(hit, BLOCKED_LOGIT)
        if bias:
            assert self.bias is not None
            x = x + self.bias.index_select(0, b.slots)
        if masked:
            x = ops.apply_token_bitmask(x, b.mask)
        if self.limit is not None:
            x = x.clone()
            x[:, self.limit:] = float("-inf")
        ok_logits = torch.isfinite(x.amax(-1))
        x = torch.where(ok_logits[:, None], x, torch.zeros_like(x))
        if smooth:  # quadratic smoothing of the first softmax: exp(-(l - max)^2 * s / T)
            sf = b.ext[:, 13:14]
            z = -(x - x.amax(-1, keepdim=True)).square() * sf
            x = torch.where(sf > 0, torch.where(torch.isfinite(x), z, torch.full_like(z, float("-inf"))), x)
        # rows without top-k whose survivors pass the candidates: the kernel's whole-vocabulary launches finish
        # them (only steps with such rows capture those launches)
        if cand:
            tokens, probs = self._candidate_steps(x, b, full)
        else:
            tokens, probs = ops.sample_top(x, b.params, b.rng, K_MAX, whole_vocab=full)
        b.tokens.copy_(tokens)
        b.probs.copy_(probs)
        b.ok.copy_(ok_in & ok_logits & (probs > 0))
        if pen:
            assert self.counts is not None and self.window is not None
            flat = b.slots * self.vocab + tokens
            self.counts.view(-1).scatter_add_(0, flat, torch.ones(flat.shape, device=flat.device))
            shifted = torch.cat([self.window.index_select(0, b.slots)[:, 1:], tokens[:, None]], dim=1)
            self.window.index_copy_(0, b.slots, shifted)
        b.rng[:, 1] += 1

    def _windowed(self, b: _Bucket, wmax: torch.Tensor, wsum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with a penalty range: weights over their slot's newest tokens (the host chain's
        penalties.context_weights: the newest `range` count fully, the `decay` before them fade linearly)."""
        assert self.window is not None
        win = self.window.index_select(0, b.slots)  # [R, WINDOW]
        rng, decay = b.pen[:, 3:4], b.pen[:, 4:5]
        age = self._age[None]
        fade = (1.0 - (age - rng) / decay.clamp_min(1.0)).clamp(0.0, 1.0)
        w = torch.where(age < rng, torch.ones_like(fade), torch.where(decay > 0, fade, torch.zeros_like(fade)))
        w = w * ((win >= 0) & (win < self.vocab))
        ids = win.clamp(0, self.vocab - 1)
        wm = torch.zeros_like(wmax).scatter_reduce_(1, ids, w, reduce="amax")
        ws = torch.zeros_like(wsum).scatter_add_(1, ids, w)
        use = rng >= 0
        return torch.where(use, wm, wmax), torch.where(use, ws, wsum)

    def _candidate_steps(self, x: torch.Tensor, b: _Bucket, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The host chain's steps after min-p, on each row's K_MAX candidates (rows that use none keep the fused
        kernel's draw): TFS, typical, dynamic or last temperature, XTC, then the draw at the kernel's point.
        Returns (tokens, probabilities)."""
        tokens, probs, q, ids, r = ops.sample_top_candidates(x, b.params, b.rng, K_MAX, whole_vocab=whole)
        q, ids = self._chain(q, ids, b.ext)
        idx, prob = draw(q, r.view(-1, 1))
        e = b.ext
        use = (e[:, 0] + e[:, 2] + e[:, 4] + e[:, 8] + e[:, 10]) > 0
        return torch.where(use, ids.gather(-1, idx).view(-1), tokens), torch.where(use, prob.view(-1), probs)

    def _chain(self, q: torch.Tensor, ids: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TFS, typical, dynamic or last temperature and XTC where each row's `ext_params` turn them on; the
        candidates come back in descending order (XTC may reorder)."""
        q = torch.where(e[:, 0:1] > 0, truncation.tail_free(q, e[:, 1:2]), q)
        q = torch.where(e[:, 2:3] > 0, truncation.typical(q, e[:, 3:4]), q)
        q = torch.where(e[:, 4:5] > 0, dynamic_temperature(q, e[:, 5:6], e[:, 6:7], e[:, 7:8]), q)
        q = torch.where(e[:, 8:9] > 0, apply_temperature(q, e[:, 9:10]), q)
        q = torch.where(e[:, 10:11] > 0, xtc(q, ids, e[:, 11:12], e[:, 12:13], self._xtc_ignore()), q)
        q, order = q.sort(dim=-1, descending=True, stable=True)
        return q, ids.gather(-1, order)

    def _xtc_ignore(self) -> torch.Tensor | None:
        if not hasattr(self, "_ignore"):
            from exlpy.generator.sampling.chain import _token_mask
            from exlpy.generator.sampling.tokenizer_info import default_xtc_ignore

            self._ignore = _token_mask(self.tokenizer, "xtc", None, default_xtc_ignore, self.vocab, self.device)
        return self._ignore

    def _capture(self, b: _Bucket, feats: tuple[bool, ...]) -> Any:
        """Warm up (compiles the kernels) on a side stream, then capture. The warm-up runs this step: the state it
        changes (counters, counts, windows) is reset before each of its two runs, so it advances once; capturing
        runs nothing, and the graph is replayed from the next step on."""
        state = [t for t in (b.rng, self.counts, self.window) if t is not None]
        snapshot = [t.clone() for t in state]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                for t, saved in zip(state, snapshot):
                    t.copy_(saved)
                self._step(b, feats)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads (the event loop, grammar workers) may use CUDA meanwhile
        with gc_paused(collect=False), \
                torch.cuda.graph(g, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            self._step(b, feats)
        return g


def _forget(table: dict[int, int], slot: int, key: int) -> None:
    if table.get(slot) == key:
        del table[slot]


def _on(device: torch.device) -> Any:
    """The device's context (Triton launches and graph captures use the current device: under a layer split the
    logits are on the last GPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def upload(src: torch.Tensor, dst: torch.Tensor | None,
            split: tuple[torch.Tensor, ...] | None = None) -> None:
    """Host tensor -> device buffer(s) through pinned memory, without waiting for the device. With `split`,
    `src` is the concatenation of the flattened buffers in order."""
    targets = split if split is not None else (dst,)
    on_cuda = targets[0] is not None and targets[0].device.type == "cuda"  # type: ignore[union-attr]
    if on_cuda:
        src = src.pin_memory()
    flat = src.reshape(-1)
    k = 0
    for t in targets:
        assert t is not None
        n = t.numel()
        t.view(-1).copy_(flat[k:k + n], non_blocking=on_cuda)
        k += n


def wanted(model: Any, device: torch.device, flag: bool | None) -> bool:
    """Whether a generator samples through `GraphSampler`: `flag` when set (tests compare both paths), else
    (unless EXLPY_GRAPH_SAMPLING=0, exlpy/runtime.py) where decode steps run as CUDA graphs (a CUDA device, graphs
    not turned off, the Triton kernels present)."""
    from exlpy.runtime import options

    if flag is not None:
        return flag
    return (options().graph_sampling and device.type == "cuda" and not getattr(model.config, "no_graphs", False)
            and ops.has_cuda_kernels())


def for_logits(logits: torch.Tensor, slots: int, tokenizer: Any) -> GraphSampler:
    """A sampler for logits like these [B, V] (their vocabulary and device; the tokenizer's size as the host
    chain's vocab-limit step)."""
    from exlpy.generator.sampling.tokenizer_info import vocab_size

    vocab, device = logits.shape[-1], logits.device
    limit = vocab_size(tokenizer) if tokenizer is not None else None
    return GraphSampler(vocab, device, slots, limit, tokenizer=tokenizer)
