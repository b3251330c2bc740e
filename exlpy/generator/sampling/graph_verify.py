"""Speculative verification on the captured sampler's kernels (GraphSampler.verify): the rejection rule of
exlpy/generator/speculative/verify.py as fixed-shape device work, one CUDA graph per (row bucket, T, feature set).
Each row's parameters are repeated at its T positions, with the position's draw point from the host (the job's
generator, as `verify_rows` takes them); the fused kernel's candidates feed `verify_group`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from exlpy.capture import gc_paused
from exlpy.engine.graphs import bucket_for
from exlpy.generator.sampling.graph_params import K_MAX, NEXT, ext_params, row_params
from exlpy.generator.sampling.graphed import upload
from exlpy.generator.sampling.settings import SamplerSettings
from exlpy.kernels import ops
from exlpy.kernels.sample_top import NPARAM

if TYPE_CHECKING:
    from exlpy.generator.sampling.graphed import GraphSampler  # graphed imports this module on first use


@dataclass
class _VerifyBucket:
    """Static buffers of verification steps of R rows x T positions (rows flattened with their positions)."""

    rows: int
    T: int
    x: torch.Tensor  # [R*T, V]
    params: torch.Tensor  # [R*T, NPARAM]: each row's parameters at each position, r = the position's point
    rng: torch.Tensor  # [R*T, 2] (unused: the points come from the host)
    ext: torch.Tensor  # [R*T, NEXT]
    drafts: torch.Tensor  # [R, T-1] int64
    u: torch.Tensor  # [R, T-1] acceptance points
    m: torch.Tensor  # [R] out: accepted drafts
    tok: torch.Tensor  # [R] out: the token the target adds
    graphs: dict[tuple[bool, bool], Any]
    held: dict[str, Any] = field(default_factory=dict)


class Verifier:
    """Speculative verification (the rejection rule of exlpy/generator/speculative/verify.py) as fixed-shape
    device work, one CUDA graph per (row bucket, T, feature set), on a `GraphSampler`'s kernels."""

    def __init__(self, owner: GraphSampler) -> None:
        self.owner = owner
        self.buckets: dict[tuple[int, int], _VerifyBucket] = {}

    def run(self, logits: torch.Tensor, drafts: torch.Tensor, settings: list[SamplerSettings],
            u: list[list[float]], r: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.owner
        n, T, _ = logits.shape
        k = T - 1
        size = bucket_for(n) or n
        vb = self.buckets.get((size, T))
        if vb is None:
            d, R = g.device, size
            vb = self.buckets[(size, T)] = _VerifyBucket(
                R, T, torch.zeros(R * T, g.vocab, device=d), torch.ones(R * T, NPARAM, device=d),
                torch.zeros(R * T, 2, dtype=torch.int64, device=d), torch.zeros(R * T, NEXT, device=d),
                torch.zeros(R, max(k, 1), dtype=torch.int64, device=d), torch.zeros(R, max(k, 1), device=d),
                torch.zeros(R, dtype=torch.int64, device=d), torch.zeros(R, dtype=torch.int64, device=d), {})
        pad = vb.rows - n
        floats: list[float] = []
        row_ext = [ext_params(s) for s in settings]
        for s, pts in zip(settings, r):
            for t in range(T):
                floats += row_params(s, g.vocab, pts[t])
        floats += [1.0, 1.0, 2.0, 0.0, 0.0, 1.0, 0.0] * (pad * T)
        exts = [v for e in row_ext for _ in range(T) for v in e] + [0.0] * (NEXT * pad * T)
        cand = any(e[0] or e[2] or e[4] or e[8] or e[10] for e in row_ext)
        smooth = any(e[13] > 0.0 for e in row_ext)
        upload(torch.tensor(floats, dtype=torch.float32), vb.params.view(-1))
        if cand or smooth:
            upload(torch.tensor(exts, dtype=torch.float32), vb.ext.view(-1))
        if k:
            upload(torch.tensor([x for row in u for x in row] + [0.0] * (pad * k), dtype=torch.float32),
                    vb.u.view(-1))
            vb.drafts[:n].copy_(drafts)
        vb.x.view(vb.rows, T, -1)[:n].copy_(logits.float())
        feats = (smooth, cand)
        if not g.capture:
            self._step(vb, feats)
        else:
            graph = vb.graphs.get(feats)
            if graph is None:
                graph = vb.graphs[feats] = self._capture(vb, feats)
            else:
                graph.replay()
        return vb.m[:n], vb.tok[:n]

    def _step(self, vb: _VerifyBucket, feats: tuple[bool, bool]) -> None:
        from exlpy.generator.speculative.verify import verify_group

        smooth, cand = feats
        x = vb.x
        x = torch.where(torch.isfinite(x.amax(-1, keepdim=True)), x, torch.zeros_like(x))
        if smooth:
            sf = vb.ext[:, 13:14]
            z = -(x - x.amax(-1, keepdim=True)).square() * sf
            x = torch.where(sf > 0, torch.where(torch.isfinite(x), z, torch.full_like(z, float("-inf"))), x)
        if self.owner.limit is not None:
            x = x.clone()
            x[:, self.owner.limit:] = float("-inf")
        # verify_capable rows keep their whole distribution among the candidates: no whole-vocabulary launches
        _, _, q, ids, r = ops.sample_top_candidates(x, vb.params, vb.rng, K_MAX, whole_vocab=False)
        if cand:
            q, ids = self.owner._chain(q, ids, vb.ext)
        R, T, C = vb.rows, vb.T, q.shape[-1]
        k = T - 1
        m, tok = verify_group(q.view(R, T, C), ids.view(R, T, C), vb.drafts[:, :k], vb.u[:, :k], r.view(R, T))
        vb.m.copy_(m)
        vb.tok.copy_(tok)

    def _capture(self, vb: _VerifyBucket, feats: tuple[bool, bool]) -> Any:
        g = self.owner
        stream = torch.cuda.Stream(g.device)
        stream.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles; the second run leaves this step's results
                self._step(vb, feats)
        torch.cuda.current_stream(g.device).wait_stream(stream)
        torch.cuda.synchronize(g.device)
        if g._pool is None:
            g._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        saved = (vb.m.clone(), vb.tok.clone())
        with gc_paused(collect=False), \
                torch.cuda.graph(graph, pool=g._pool, stream=stream, capture_error_mode="thread_local"):
            self._step(vb, feats)
        vb.m.copy_(saved[0])
        vb.tok.copy_(saved[1])
        return graph
