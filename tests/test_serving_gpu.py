"""`exlpy serve` on a GPU: the default cache fills the memory `--gpu-memory-utilization` allows and no more, and
after the warm-up no request of any size waits for a Triton compile (tiny model of ../shared)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tests.conftest import shared_path

pytestmark = [pytest.mark.gpu, pytest.mark.exclusive_gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


ROOM = 2 * 2**30  # what the test lets the server take beyond what is in use (other tests may share the GPU)


def _shared_gpu() -> bool:
    import os

    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


@pytest.fixture(scope="module")
def state() -> Any:
    from exlpy.runtime import options
    from exlpy.server import load_state
    from exlpy.server.sizing import CHUNK_GRAPHS_MARGIN, RUNTIME_MARGIN

    free, total = torch.cuda.mem_get_info()
    margin = (RUNTIME_MARGIN + (CHUNK_GRAPHS_MARGIN if options().prefill_graphs else 0.0)) * total  # kept free
    util = min(1.0, (total - free + ROOM + margin) / total)
    s = load_state(str(shared_path("models", "tiny-llama-fp16")), max_seq_len=4096, max_batch_size=16,
                   gpu_memory_utilization=util)
    yield s
    del s
    torch.cuda.empty_cache()


def test_default_cache_takes_the_allowed_memory(state: Any) -> None:
    from exlpy.server.loading import cache_plan_of

    plan = cache_plan_of(state.bridge.generator)
    assert plan.source.startswith("free GPU memory") and plan.full_requests >= 8
    cache_bytes = sum(state.bridge.generator.cache.footprint().values())
    assert abs(cache_bytes - plan.bytes) <= 4096
    # About ROOM: the weights were in use already; activations, graphs and other processes' drift take a little.
    # Other test processes sharing the GPU (pytest-xdist) free memory between the fixture's reading and the
    # server's own: with 16 workers on one H200 the cache came out at 3.9 GB for a 2 GiB room.
    drift = 0 if torch.cuda.device_count() and not _shared_gpu() else 2 * ROOM
    assert 0.5 * ROOM <= cache_bytes <= ROOM + drift


def test_no_compile_while_serving_after_the_warmup(state: Any) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from exlpy.server import create_app
    from exlpy.server.metrics import KernelCompiles

    if not KernelCompiles.available:
        pytest.skip("this Triton has no compile hook")
    before = KernelCompiles.serving

    async def main() -> list[Any]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as c:
            try:
                g = torch.Generator().manual_seed(0)
                lengths = [1, 3, 17, 100, 255, 700, 1500, 3000]
                bodies = [{"prompt": torch.randint(3, 500, (n,), generator=g).tolist(), "max_tokens": 40,
                           "temperature": 0.7 if k % 2 else 0, "top_p": 0.9} for k, n in enumerate(lengths)]
                return list(await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies]))
            finally:
                await state.bridge.stop()

    rs = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    if KernelCompiles.serving != before:
        pytest.fail("compiled while serving:\n" + "\n".join(_explain(k, KernelCompiles.keys)
                                                              for k in KernelCompiles.last))


def _explain(new: str, seen: list[str]) -> str:
    """Which arguments of a kernel compiled while serving differ from the nearest variant compiled before (the
    warm-up's): names and (type, specialization) pairs, so the shape the warm-up missed can be read off."""
    import ast
    import sys

    def parse(entry: str) -> tuple[str, list[Any]] | None:
        if " key=" not in entry:
            return None
        head, key = entry.split(" key=", 1)
        try:
            return head.split("[", 1)[0], list(ast.literal_eval(key[:key.rindex("]") + 1]))
        except (ValueError, SyntaxError):
            return None

    got = parse(new)
    if got is None:
        return new
    name, args = got
    fn = next((getattr(m, name) for k, m in list(sys.modules.items()) if k.startswith("exlpy.kernels")
               and hasattr(m, name)), None)
    names = list(getattr(fn, "arg_names", [])) or [str(i) for i in range(len(args))]
    best: list[str] | None = None
    for entry in seen:
        other = parse(entry)
        if other is None or other[0] != name or other[1] == args or len(other[1]) != len(args):
            continue
        diff = [f"{names[i] if i < len(names) else i}: {other[1][i]} -> {a}" for i, a in enumerate(args)
                if other[1][i] != a]
        if best is None or len(diff) < len(best):
            best = diff
    return f"{name}: " + ("; ".join(best) if best is not None else "no earlier variant of this kernel")
