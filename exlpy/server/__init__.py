"""OpenAI-compatible HTTP server over the dynamic generator (`exlpy serve`).

fastapi is imported only by `create_app` (the optional `server` extra), so the bridge and the loader can be
used without it.
"""

from __future__ import annotations

from typing import Any

from exlpy.server.bridge import GeneratorBridge, JobFailedError, JobHandle, ServerBusyError
from exlpy.server.state import ServerState, load_state, state_from_generator


def create_app(state: ServerState) -> Any:
    """The FastAPI app serving `state` (see exlpy/server/app.py)."""
    from exlpy.server.app import create_app as _create_app

    return _create_app(state)


__all__ = ["GeneratorBridge", "JobFailedError", "JobHandle", "ServerBusyError", "ServerState", "create_app",
           "load_state", "state_from_generator"]
