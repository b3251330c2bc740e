"""The tensor-parallel benchmark's timers (one GPU or TP alike): decode steps read back or fed on the device,
prefill, the profiler's top kernels of decode steps, memory per GPU."""

from __future__ import annotations

import time

import torch

from benchmarks.tp_diag import top_kernels
from exlpy import ExLlamaV2


def sync_all(n: int) -> None:
    for i in range(n):
        torch.cuda.synchronize(i)


def decode_ms(model: ExLlamaV2, cache, prompt: torch.Tensor, steps: int, n: int) -> float:
    """ms per decode step of prompt.shape[0] rows, the argmax taken on the GPU and read back every step."""
    cache.current_seq_len = 0
    logits = model.forward(prompt, cache, last_id_only=True)
    tok = logits[:, -1:].argmax(-1).cpu()
    for _ in range(3):
        model.forward(tok, cache)
    sync_all(n)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model.forward(tok, cache)[:, -1:].argmax(-1).cpu()  # a real sampling loop reads the token back
    sync_all(n)
    return (time.perf_counter() - t0) / steps * 1e3


def decode_fed_ms(model: ExLlamaV2, cache, prompt: torch.Tensor, steps: int, n: int) -> float:
    """ms per decode step when each step's argmax stays on the GPU and is the next step's input, the host
    reading every token one step late: the generators' overlapped loop (sampling on the device)."""
    cache.current_seq_len = 0
    tok = model.forward(prompt, cache, last_id_only=True)[:, -1:].argmax(-1)
    for _ in range(3):
        tok = model.forward(tok, cache)[:, -1:].argmax(-1)
    sync_all(n)
    t0 = time.perf_counter()
    prev = None
    for _ in range(steps):
        nxt = model.forward(tok, cache)[:, -1:].argmax(-1)
        if prev is not None:
            prev.cpu()  # step k-1's token, while step k runs
        prev, tok = tok, nxt
    sync_all(n)
    return (time.perf_counter() - t0) / steps * 1e3


def prefill_ms(model: ExLlamaV2, cache, ids: torch.Tensor, n: int) -> float:
    return prefill_times(model, cache, ids, n)[0]


def prefill_times(model: ExLlamaV2, cache, ids: torch.Tensor, n: int) -> tuple[float, float]:
    """Best of 3 prefills (last position's logits): ms until the GPUs are done, and ms until `forward` returned
    on the host (launching everything; close to the first when the host, not the GPUs, sets the pace)."""
    cache.current_seq_len = 0
    model.forward(ids, cache, preprocess_only=True)
    sync_all(n)
    best, host = 1e9, 1e9
    for _ in range(3):
        cache.current_seq_len = 0
        sync_all(n)
        t0 = time.perf_counter()
        model.forward(ids, cache, last_id_only=True)
        t1 = time.perf_counter()
        sync_all(n)
        best, host = min(best, time.perf_counter() - t0), min(host, t1 - t0)
    return best * 1e3, host * 1e3


def profile_steps(model: ExLlamaV2, cache, prompt: torch.Tensor, n: int, steps: int = 10) -> list[dict]:
    """The most expensive kernels of `steps` captured decode steps (device-fed), summed over the GPUs."""
    cache.current_seq_len = 0
    tok = model.forward(prompt, cache, last_id_only=True)[:, -1:].argmax(-1)
    tok = model.forward(tok, cache)[:, -1:].argmax(-1)

    def run() -> None:
        t = tok
        for _ in range(steps):
            t = model.forward(t, cache)[:, -1:].argmax(-1)

    return top_kernels(run, n, rows=16)


def mem(n: int) -> list[dict]:
    return [{"alloc_MiB": round(torch.cuda.memory_allocated(i) / 2**20, 1),
             "max_MiB": round(torch.cuda.max_memory_allocated(i) / 2**20, 1)} for i in range(n)]
