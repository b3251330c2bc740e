"""Admin routes (TabbyAPI's): load, unload and switch the model, load and unload LoRA adapters, without
restarting. They need an admin key (exlpy/server/auth.py).

A change closes the model gate (new model requests get 503 saying what is happening), lets the requests in
flight finish, makes the change, and reopens (exlpy/server/lifecycle.py `exclusive`). Loading runs in a worker
thread, so /health keeps answering. Models and adapters are named relative to the server's model and LoRA
directories (`--model-dir`, `--lora-dir`; TabbyAPI's `model_dir`, `lora_dir`), never by arbitrary path.

| route | body | what |
|---|---|---|
| GET /v1/model | | the loaded model and how it was loaded (API key) |
| POST /v1/model/load | `{model_name, max_seq_len, cache_mode, gpu_split, ...}` | unload the model, load this one |
| POST /v1/model/unload | | unload the model (model routes answer 503 until a load) |
| GET /v1/lora, /v1/loras | | the loaded adapters (API key) |
| POST /v1/lora/load | `{loras: [{name, scaling}]}` | load adapters, each served as a model of its own |
| POST /v1/lora/unload | `{loras: [name, ...]}` (optional) | unload those adapters (all without a list) |
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from exlpy.errors import ConfigError, ExlpyError
from exlpy.server.bridge import GeneratorBridge
from exlpy.server.lifecycle import exclusive
from exlpy.server.options import LoraSpec, model_options, resolve_child
from exlpy.server.state import ServerState


class AdminError(ExlpyError, ValueError):
    """An admin request names something that cannot be loaded or unloaded."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class DraftLoad(Strict):
    draft_model_name: str
    draft_rope_scale: float | None = None
    draft_rope_alpha: float | None = None
    draft_cache_mode: str | None = None
    draft_gpu_split: list[float] | None = None


class ModelLoad(Strict):
    model_name: str | None = None
    name: str | None = None  # TabbyAPI's older spelling of model_name
    served_model_name: str | None = None
    max_seq_len: int | None = None
    cache_size: int | None = None
    cache_mode: str | None = None
    gpu_split_auto: bool | None = None
    gpu_split: list[float] | None = None
    autosplit_reserve: list[int] | None = None
    tensor_parallel: bool | None = None
    rope_scale: float | None = None
    rope_alpha: float | str | None = None
    prompt_template: str | None = None
    max_batch_size: int | None = None
    chunk_size: int | None = None
    draft_model: DraftLoad | None = None


class LoraItem(Strict):
    name: str
    scaling: float = 1.0


class LoraLoad(Strict):
    loras: list[LoraItem]


class LoraUnload(Strict):
    loras: list[str] | None = None


def model_card(state: ServerState) -> dict[str, Any]:
    opts = state.model_options
    g = state.generator
    params: dict[str, Any] = {"max_seq_len": g.max_seq_len, "cache_size": g.num_pages * 256}
    if opts is not None:
        params.update({k: v for k, v in asdict(opts).items() if k not in ("loras", "draft") and v is not None})
        params["draft_model"] = opts.draft.model_dir if opts.draft else None
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "exlpy",
            "parameters": params, "loras": sorted(state.adapters)}


def lora_cards(state: ServerState) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "lora", "root": lora.directory,
                                        "scaling": float(getattr(lora, "lora_scaling", 1.0))}
                                       for name, lora in state.adapters.items()]}


async def _unload_current(state: ServerState) -> None:
    from exlpy.server.loading import unload_generator

    bridge, adapters = state.bridge, state.adapters
    if bridge is None:
        return
    await bridge.stop()
    state.bridge, state.adapters = None, {}
    await asyncio.to_thread(unload_generator, bridge.generator, adapters)


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/model")
    async def current_model() -> dict[str, Any]:
        if state.bridge is None:
            raise AdminError("no model is loaded (POST /v1/model/load loads one)")
        return model_card(state)

    @app.post("/v1/model/load")
    async def load_model(req: ModelLoad) -> dict[str, Any]:
        from exlpy import ExLlamaV2Config
        from exlpy.server.loading import load_generator

        name = req.model_name or req.name
        if not name:
            raise AdminError("model_name: name the model directory to load (inside --model-dir)", "model_name")
        values = req.model_dump(exclude={"model_name", "name", "draft_model"}, exclude_none=True)
        if req.draft_model is not None:
            values.update(req.draft_model.model_dump(exclude_none=True))
            values["draft_model_dir"] = state.models_root
        try:
            opts = model_options({**values, "model_dir": state.models_root, "model_name": name})
        except ConfigError as e:
            raise AdminError(str(e), "model_name") from None
        assert opts.model_dir is not None
        if not os.path.isfile(os.path.join(opts.model_dir, "config.json")):
            raise AdminError(f"model_name: {name!r} is not a model directory inside --model-dir "
                             f"({state.models_root})", "model_name")
        # A config.json that does not parse fails here, before the current model is unloaded.
        await asyncio.to_thread(ExLlamaV2Config, opts.model_dir)
        async with exclusive(state, f"loading model {opts.name}"):
            await _unload_current(state)
            generator, adapters = await asyncio.to_thread(load_generator, opts)
            state.bridge = GeneratorBridge(generator, max_queue=state.max_queue)
            state.bridge.start()
            state.tokenizer, state.model_name = generator.tokenizer, opts.name
            state.adapters, state.model_options = adapters, opts
        return model_card(state)

    @app.post("/v1/model/unload")
    async def unload_model() -> dict[str, Any]:
        if state.bridge is None:
            raise AdminError("no model is loaded")
        name = state.model_name
        async with exclusive(state, f"unloading model {name}"):
            await _unload_current(state)
        return {"unloaded": name}

    @app.get("/v1/lora")
    @app.get("/v1/loras")
    async def loras() -> dict[str, Any]:
        return lora_cards(state)

    @app.post("/v1/lora/load")
    async def load_loras(req: LoraLoad) -> dict[str, Any]:
        from exlpy.server.lora import load_adapters

        if state.bridge is None:
            raise AdminError("no model is loaded to apply adapters to")
        specs = []
        for i, item in enumerate(req.loras):
            try:
                specs.append(LoraSpec(item.name, resolve_child(state.loras_root, item.name, "--lora-dir"),
                                      item.scaling))
            except ConfigError as e:
                raise AdminError(f"loras[{i}].name: {e}", f"loras[{i}].name") from None
            if item.name in state.adapters:
                raise AdminError(f"loras[{i}].name: {item.name!r} is already loaded", f"loras[{i}].name")
        bridge = state.bridge
        async with exclusive(state, "loading LoRA adapters"):
            loaded = await bridge.run_exclusive(
                lambda: load_adapters(bridge.generator.model, tuple(specs), state.model_name))
            state.adapters = {**state.adapters, **loaded}
        return {"success": sorted(loaded), "failure": []}

    @app.post("/v1/lora/unload")
    async def unload_loras(req: LoraUnload | None = None) -> dict[str, Any]:
        names = list(state.adapters) if req is None or req.loras is None else req.loras
        for i, n in enumerate(names):
            if n not in state.adapters:
                raise AdminError(f"loras[{i}]: {n!r} is not loaded (loaded: {', '.join(state.adapters) or 'none'})",
                                 f"loras[{i}]")
        if state.bridge is None or not names:
            return {"unloaded": []}
        bridge = state.bridge
        async with exclusive(state, "unloading LoRA adapters"):
            gone = [state.adapters[n] for n in names]
            await bridge.run_exclusive(lambda: [lora.unload() for lora in gone])
            state.adapters = {k: v for k, v in state.adapters.items() if k not in names}
        return {"unloaded": names}
