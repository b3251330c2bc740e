"""API and admin keys of `exlpy serve`: an ASGI middleware in front of every route, so a route added later is
keyed by default; the routes that stay open are listed here (`open_routes`).

- A key is sent as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (`x-admin-key` too, as
  TabbyAPI's clients send it). Every presented key is compared with every configured key in constant time
  (hmac.compare_digest, without stopping at the first match), so the answer time does not tell how much of a
  key was right.
- Routes: open (/health; /metrics unless --metrics-require-key), user (everything else; open when no
  --api-key is set), admin (model and adapter loading; an admin key is needed, and without --admin-key they
  are disabled). An admin key is accepted wherever an API key is. `disable_auth` (TabbyAPI's network key)
  opens every route, admin routes included.
- A missing or wrong key answers 401 in OpenAI's error shape (`code: invalid_api_key`), a user key on an
  admin route 403.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

OPEN_ROUTES = frozenset({"/health"})
METRICS_ROUTE = "/metrics"
# Admin routes (exlpy/server/admin.py): loading and unloading models and adapters.
ADMIN_ROUTES = frozenset({"/v1/model/load", "/v1/model/unload", "/v1/lora/load", "/v1/lora/unload"})


def open_routes(metrics_require_key: bool) -> frozenset[str]:
    return OPEN_ROUTES if metrics_require_key else OPEN_ROUTES | {METRICS_ROUTE}


def _matches(presented: list[bytes], keys: Iterable[bytes]) -> bool:
    found = False
    for p in presented:
        for k in keys:
            found |= hmac.compare_digest(p, k)  # no short cut: every pair is compared
    return found


class KeyPolicy:
    """Which role a route needs and whether a request's headers carry a key for it."""

    def __init__(self, api_keys: Iterable[str] = (), admin_keys: Iterable[str] = (), disable_auth: bool = False,
                 metrics_require_key: bool = False) -> None:
        self.api_keys = [k.encode() for k in api_keys]
        self.admin_keys = [k.encode() for k in admin_keys]
        self.disable_auth = disable_auth
        self.open = open_routes(metrics_require_key)

    @property
    def keyed(self) -> bool:
        return bool(self.api_keys) and not self.disable_auth

    def role_of(self, path: str) -> str:
        path = "/" + "/".join(p for p in path.split("/") if p)  # "/v1//model/load/" is the admin route too
        if path in ADMIN_ROUTES:
            return "admin"
        return "open" if path in self.open else "user"

    def refusal(self, path: str, headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        """None when the request may go on, else (status, message, code)."""
        role = self.role_of(path)
        if role == "open" or self.disable_auth:
            return None
        presented = presented_keys(headers)
        if role == "admin":
            if not self.admin_keys:
                return 403, (f"{path} is an admin route and this server has no admin key: start it with "
                             "--admin-key (or an api_tokens file with admin_key)"), "admin_disabled"
            if _matches(presented, self.admin_keys):
                return None
            if presented and _matches(presented, self.api_keys):
                return 403, f"{path} needs an admin key; the key sent is an API key", "insufficient_permissions"
            return 401, _missing(presented, "an admin key"), "invalid_api_key"
        if not self.api_keys:
            return None
        if _matches(presented, self.api_keys) or _matches(presented, self.admin_keys):
            return None
        return 401, _missing(presented, "an API key"), "invalid_api_key"


def _missing(presented: list[bytes], what: str) -> str:
    if presented:
        return f"Incorrect API key provided: this route needs {what}"
    return (f"You didn't provide an API key: this route needs {what}, sent as `Authorization: Bearer KEY` or "
            "`x-api-key: KEY`")


def presented_keys(headers: dict[bytes, bytes]) -> list[bytes]:
    out = []
    auth = headers.get(b"authorization", b"").strip()
    scheme, _, token = auth.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        out.append(token.strip())
    for name in (b"x-api-key", b"x-admin-key"):
        value = headers.get(name, b"").strip()
        if value:
            out.append(value)
    return out


class RequireKeys:
    """ASGI middleware applying a KeyPolicy to every HTTP request."""

    def __init__(self, app: Any, policy: KeyPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        refused = self.policy.refusal(scope.get("path", ""), headers)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message, code = refused
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *extra]})
        await send({"type": "http.response.body", "body": body})
