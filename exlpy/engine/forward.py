"""`model.forward` and `model.forward_batch`: argument checks, chunking, and the choice between a captured
step and an eager one. Both end in the loaded strategy's stages (strategy.execute or the graph runner)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from exlpy.engine.graphs import CHUNK_BUCKETS, MAX_Q_LEN, StepGraphs
from exlpy.engine.pipeline import execute_pipelined, pipeline_applies
from exlpy.engine.strategy import Strategy, execute
from exlpy.errors import CacheTooSmallError, SequenceLengthError
from exlpy.kernels import ops
from exlpy.model.batch import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, ForwardBatch, build_batch, upload_ids
from exlpy.model.validate import check_forward
from exlpy.runtime import options


def graph_runner(model: Any, strategy: Strategy) -> StepGraphs | None:
    """The strategy's graph runner, or None where graphs do not apply (CPU, no Triton, config.no_graphs, a
    module whose step synchronises with the host: MoE blocks with quantized experts)."""
    if model.config.no_graphs or not strategy.graph_safe or not all(getattr(m, "graph_safe", True)
                                                                     for m in model.modules):
        return None
    runner = strategy.graph_cache.get("runner")
    if runner is None:
        runner = strategy.graph_cache["runner"] = StepGraphs(strategy)
    # MoE blocks' graphs bake in the experts per token (exllamav2's -ept), which may be set between calls
    k = model.config.num_experts_per_token
    if strategy.graph_cache.get("experts_per_token", k) != k:
        runner.clear()
    strategy.graph_cache["experts_per_token"] = k
    return runner


def _logits_mode(preprocess_only: bool, last_id_only: bool) -> str:
    return LOGITS_NONE if preprocess_only else LOGITS_LAST if last_id_only else LOGITS_ALL


def forward(model: Any, input_ids: torch.Tensor, cache: Any = None, input_mask: torch.Tensor | None = None,
            preprocess_only: bool = False, last_id_only: bool = False, loras: Any = None,
            return_last_state: bool = False, position_offsets: torch.Tensor | None = None,
            abort_event: Any = None, cpu_logits: bool = False, indexed_embeddings: Any = None) -> Any:
    from exlpy.vision.embedding import check_embeddings

    mm = check_embeddings(indexed_embeddings, model, "indexed_embeddings")
    if mm:
        if position_offsets is not None:
            from exlpy.errors import NotSupportedError

            raise NotSupportedError("model.forward(): position_offsets cannot be combined with indexed_embeddings")
        if loras:
            from exlpy.lora.slots import adapter_rows

            with adapter_rows(model, loras) as (slot, generation):
                return _forward(model, input_ids, cache, input_mask, preprocess_only, last_id_only,
                                return_last_state, None, cpu_logits, slot, generation, mm)
        return _forward(model, input_ids, cache, input_mask, preprocess_only, last_id_only, return_last_state,
                        None, cpu_logits, mm=mm)
    if loras:  # every row uses the same adapters: one slot, held for the call (exlpy/lora/slots.py)
        from exlpy.lora.slots import adapter_rows

        with adapter_rows(model, loras) as (slot, generation):
            return _forward(model, input_ids, cache, input_mask, preprocess_only, last_id_only, return_last_state,
                            position_offsets, cpu_logits, slot, generation)
    return _forward(model, input_ids, cache, input_mask, preprocess_only, last_id_only, return_last_state,
                    position_offsets, cpu_logits)


def _forward(model: Any, input_ids: torch.Tensor, cache: Any, input_mask: torch.Tensor | None,
             preprocess_only: bool, last_id_only: bool, return_last_state: bool,
             position_offsets: torch.Tensor | None, cpu_logits: bool, adapter: int = -1, lora: int = 0,
             mm: list[Any] | None = None) -> Any:
    strategy = model.strategy_for_forward()
    input_ids = check_forward(model, input_ids, cache, mm)
    B, T = input_ids.shape
    adapters = [adapter] * B if lora else None
    cfg = model.config
    dev = strategy.first_device
    mode = _logits_mode(preprocess_only, last_id_only)
    if cache is not None:
        past = cache.current_seq_len
        if B > cache.batch_size:
            raise CacheTooSmallError(f"batch size {B} exceeds the cache's batch_size {cache.batch_size}")
        if past + T > cache.max_seq_len:
            raise CacheTooSmallError(f"Total sequence length exceeds cache size in model.forward: {past} "
                                     f"cached + {T} new tokens > cache max_seq_len {cache.max_seq_len}")
        runner = graph_runner(model, strategy)
        if (runner is not None and T <= MAX_Q_LEN and input_mask is None and position_offsets is None
                and mode != LOGITS_NONE and not return_last_state and not mm):
            # A captured step: ids go straight into its static input, metadata as host integers.
            logits = runner.run_rows(input_ids, cache, [past] * B, None, cache.max_seq_len, mode, adapters, lora)
            if logits is not None:
                cache.current_seq_len = past + T
                return logits.cpu() if cpu_logits else logits
    ids = upload_ids(input_ids, dev)
    key_mask = _key_mask(input_mask, dev)
    offsets = position_offsets.to(dev).view(-1, 1) if position_offsets is not None else None
    rows_mm = None
    if mm:
        from exlpy.vision.mm import RowsMM

        # model.forward sees only this call's ids: M-RoPE positions count from the cache's length, as if
        # everything before were text (the generators keep the whole sequence and its position shift).
        rows_mm = RowsMM(model.config, input_ids, mm, cache.current_seq_len if cache is not None else 0)

    def prepare(batch: ForwardBatch, chunk_mode: str) -> ForwardBatch:
        batch.logits = chunk_mode
        batch.lora = lora
        batch.keep_last_state = return_last_state
        if offsets is not None:
            batch.rope_positions = (batch.positions + offsets).clamp(min=0)
        if rows_mm is not None:
            start = int(batch.host[0][0]) - rows_mm.past if batch.host is not None else 0
            rows_mm.attach(batch, start, start + batch.q_len, dev)
        return batch

    def finish(batch: ForwardBatch, out: torch.Tensor | None) -> Any:
        if out is not None and cpu_logits:
            out = out.cpu()
        return (out, batch.last_state) if return_last_state and out is not None else out

    def run(batch: ForwardBatch, chunk: torch.Tensor, chunk_mode: str) -> Any:
        return finish(batch, execute(strategy, chunk, prepare(batch, chunk_mode)))

    if cache is None:
        limit = cfg.max_input_len * cfg.max_batch_size // B
        if T > limit:
            raise SequenceLengthError(f"Maximum input length exceeded in model.forward: {T} tokens > "
                                      f"{limit} (max_input_len * max_batch_size // batch); pass a cache "
                                      "to process long inputs in chunks")
        return run(build_batch([0] * B, T, dev, key_mask=key_mask, adapters=adapters), ids, mode)

    # Without the flash kernel (CPU reference, EXLPY_FLASH_ATTN=0) a chunk's attention builds [T, past + T]
    # scores: max_attention_size bounds them. The flash kernel reads K/V in tiles, so only max_input_len counts.
    tiled = dev.type == "cuda" and options().flash_attn and ops.has_cuda_kernels()
    outputs: list[torch.Tensor] = []
    last_state = None
    pos = 0
    # Layer streaming runs the chunks layer-major (each module loaded once for all of them), after planning them.
    streamed = getattr(model, "stream", None) is not None
    deferred: list[tuple[ForwardBatch, torch.Tensor]] | None = [] if streamed else None
    # Tensor parallelism: long chunks as two overlapped micro-batches (plain fp16 prefill rows only).
    overlap = (strategy.overlap_prefill and key_mask is None and offsets is None and rows_mm is None and not lora
               and not return_last_state and getattr(cache, "layer_codes", None) is None)
    try:
        results = []
        while pos < T:
            # Chunks bound activation memory: max_input_len tokens, and past*q within max_attention_size.
            cur = past + pos
            att = int((math.sqrt(cur * cur + 4 * cfg.max_attention_size) - cur) / 2)
            n = max(1, min(T - pos, cfg.max_input_len, cfg.max_input_len if tiled else att))
            if rows_mm is not None:  # Gemma 3: a chunk holds whole images (their tokens see each other)
                n = rows_mm.chunk_end(pos, pos + n) - pos
            last = pos + n >= T
            batch = build_batch([cur] * B, n, dev, cache=cache, tables=[[b] for b in range(B)],
                                page_size=cache.max_seq_len, key_mask=key_mask, adapters=adapters)
            batch.past_len = cur
            chunk_mode = mode if last else LOGITS_NONE if mode != LOGITS_ALL else mode
            if deferred is not None:
                deferred.append((prepare(batch, chunk_mode), ids[:, pos:pos + n]))
            elif overlap and pipeline_applies(strategy, n, True):
                results.append(finish(batch, _run_halves(strategy, ids[:, pos:pos + n], cur, B, dev, cache,
                                                         chunk_mode)))
            else:
                results.append(run(batch, ids[:, pos:pos + n], chunk_mode))
            cache.current_seq_len = cur + n
            pos += n
        if deferred:
            from exlpy.engine.streaming import execute_layer_major

            outs = execute_layer_major(model, [c for _, c in deferred], [b for b, _ in deferred])
            results = [finish(b, out) for (b, _), out in zip(deferred, outs)]
        for r in results:
            if return_last_state and r is not None:
                r, last_state = r
            if r is not None:
                outputs.append(r)
    except BaseException:
        cache.current_seq_len = past  # a failed chunk leaves the cache's length where the caller had it
        raise
    if mode == LOGITS_NONE:
        return None
    logits = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return (logits, last_state) if return_last_state else logits


def _run_halves(strategy: Strategy, ids: torch.Tensor, cur: int, B: int, dev: torch.device, cache: Any,
                chunk_mode: str) -> torch.Tensor | None:
    """One chunk as two micro-batches (exlpy/engine/pipeline.py): the first wants logits only when every
    position's are asked for, the second as the chunk."""
    n = ids.shape[1]
    h = n // 2
    batches = []
    for start, length, mode in ((cur, h, LOGITS_ALL if chunk_mode == LOGITS_ALL else LOGITS_NONE),
                                (cur + h, n - h, chunk_mode)):
        b = build_batch([start] * B, length, dev, cache=cache, tables=[[r] for r in range(B)],
                        page_size=cache.max_seq_len)
        b.past_len = start
        b.logits = mode
        batches.append(b)
    a, b = execute_pipelined(strategy, [ids[:, :h], ids[:, h:]], batches)
    if chunk_mode == LOGITS_ALL and a is not None and b is not None:
        return torch.cat([a, b], dim=1)
    return b


def forward_batch(model: Any, input_ids: torch.Tensor, batch: ForwardBatch, last_id_only: bool = False,
                  preprocess_only: bool = False) -> torch.Tensor | None:
    """Forward with caller-built metadata (paged caches, per-row positions): the generators' entry. A mixed pass
    (model/batch.py `mixed_batch`: decode rows and prompt chunks together) always runs eagerly."""
    strategy = model.strategy_for_forward()
    mode = _logits_mode(preprocess_only, last_id_only)
    if batch.logits != mode:
        batch = replace(batch, logits=mode)
    if batch.lora:  # rows with adapters: the slot buffers on this strategy's blocks, their generation
        from exlpy.lora.slots import registry_of

        batch = replace(batch, lora=registry_of(model).ensure(strategy))
    runner = graph_runner(model, strategy)
    if runner is not None and mode != LOGITS_NONE and batch.q_len <= MAX_Q_LEN and batch.segments is None:
        logits = runner.run_batch(input_ids, batch)
        if logits is not None:
            return logits
    return execute(strategy, upload_ids(input_ids, strategy.first_device), batch)


def chunk_buckets(model: Any) -> tuple[int, ...]:
    """Sizes of the captured prompt chunks this model runs (`prefill_chunk`); empty where graphs do not apply,
    EXLPY_PREFILL_GRAPHS=0, or a chunk capture failed."""
    if not options().prefill_graphs:
        return ()
    runner = graph_runner(model, model.strategy_for_forward())
    return () if runner is None or runner.chunks_failed else CHUNK_BUCKETS


def prefill_chunk(model: Any, input_ids: torch.Tensor, batch: ForwardBatch) -> bool:
    """Run a prompt chunk ([1, n] host ids, `batch` of one row over a cache) as the captured chunk of the
    smallest bucket >= n (exlpy/engine/graphs.py `run_chunk`); False when none applies (the caller runs it
    eagerly)."""
    if not chunk_buckets(model) or input_ids.device.type != "cpu":
        return False
    runner = graph_runner(model, model.strategy_for_forward())
    assert runner is not None
    batch = replace(batch, logits=LOGITS_NONE)
    if batch.lora:
        from exlpy.lora.slots import registry_of

        batch = replace(batch, lora=registry_of(model).ensure(model.strategy_for_forward()))
    return runner.run_chunk(input_ids, batch)


def _key_mask(input_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Accept a bool mask (True = real token) or an additive one (0 = keep, -inf = pad), [B, L]."""
    if input_mask is None:
        return None
    m = input_mask.to(device)
    if m.dim() > 2:
        m = m.reshape(m.shape[0], -1)[:, -m.shape[-1]:]
    return m if m.dtype == torch.bool else m > -1.0
