"""Request routing of exlpy on Ray Serve (exlpy/server/ray_app.py): a Ray Serve request router (Ray's
`RequestRouter` API, `request_router_config`) that sends requests sharing a prompt prefix to the replica whose
prefix cache already holds it, and otherwise does what Ray's default router does (power of two choices).

The ingress (exlpy/server/ray_ingress.py) reads each request's body once and puts a routing key on the request
it forwards: the first `prefix_chars` characters of the prompt (completions) or of the chat messages (roles and
texts, in order), or the client's own `x-exlpy-routing-key` header. The router ranks the replicas for that key by
rendezvous hashing (highest hash of key + replica id first), so the choice needs no shared state: every ingress
replica picks the same replica for a key, a replica joining or leaving moves only the keys it wins or held, and
a long system prompt's pages end up on one replica instead of being prefilled again on each.

Load comes first when it has to: the preferred replica is skipped when it runs more than `imbalance` requests
above the least busy candidate (Ray's queue-length cache, probed when stale) or when it is full
(`max_ongoing_requests`); the request then goes to the less busy of the next two replicas in the key's
rendezvous order (so a hot prefix spills onto the same second replica, which then caches it too), and failing
those to the least busy replica. Requests without a key (other routes, `router=pow2`, the
`x-exlpy-routing: pow2` header) get power of two choices: two random replicas, the one with fewer requests.
`rr` is round-robin, the baseline the other two are measured against (what a plain load balancer in front of
several `exlpy serve` processes does): each ingress process hands requests to the replicas in turn, in replica id
order, blind to their queues and caches; only a full replica (`max_ongoing_requests`) is skipped, for the least
busy other one.

The router also keeps each replica's routing stats (`record_routing_stats` of the replica: its Prometheus
metrics, polled by Ray every `request_routing_stats_period_s`), which the ingress sums for `/metrics`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTING_KEY_HEADER = "x-exlpy-routing-key"  # a client's own key (a session or conversation id)
ROUTING_HEADER = "x-exlpy-routing"  # "prefix" or "pow2": this request's policy, over the app's `router`
POLICIES = ("prefix", "pow2", "rr")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")

# Routers of this process by deployment (the ingress finds its engine deployment's router here for /metrics).
ROUTERS: dict[tuple[str, str], PrefixAffinityRouter] = {}


def _text(content: Any) -> str:
    """A chat message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def routing_key(path: str, body: bytes, prefix_chars: int) -> str | None:
    """The prefix that decides where a completion or chat request goes: the first `prefix_chars` characters of
    its prompt (token ids count four characters each) or of its messages; None for other routes and bodies that
    are not such a request (the replica answers those with the right error)."""
    if not any(path.rstrip("/").endswith(p) for p in ROUTED_PATHS):
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    model = str(req.get("model") or "")  # another adapter is another cache (exlpy salts adapters' pages)
    prompt = req.get("prompt")
    if "messages" in req and isinstance(req["messages"], list):
        text = "".join(f"<{m.get('role', '')}>{_text(m.get('content'))}" for m in req["messages"]
                       if isinstance(m, dict))
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts goes where its first prompt's prefix is
        text = prompt if isinstance(prompt, str) else ",".join(map(str, prompt[:max(1, prefix_chars // 4)]))
    elif isinstance(prompt, list):
        text = ",".join(map(str, prompt[:max(1, prefix_chars // 4)]))
    elif isinstance(prompt, str):
        text = prompt
    else:
        return None
    return f"{model}\x00{text[:prefix_chars]}"


def rendezvous(key: str, replicas: Iterable[Any], ident: Any = lambda r: r.replica_id.unique_id) -> list[Any]:
    """`replicas` ranked for `key` by highest random weight: the same order in every process."""
    def weight(r: Any) -> bytes:
        return hashlib.blake2b(f"{key}\x00{ident(r)}".encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


def round_robin(turn: int, replicas: Iterable[Any], ident: Any = lambda r: r.replica_id.unique_id) -> list[Any]:
    """`replicas` in id order, starting at the one whose turn it is (`turn` modulo their number)."""
    ordered = sorted(replicas, key=ident)
    if not ordered:
        return []
    i = turn % len(ordered)
    return ordered[i:] + ordered[:i]


class PrefixAffinityRouter(RequestRouter):
    """Prefix affinity with a load bound, else power of two choices (see the module's docstring)."""

    def initialize_state(self, imbalance: int = 16, **_: Any) -> None:
        self.imbalance = int(imbalance)
        self.turn = 0  # round-robin's next turn (per ingress process, as a load balancer's own counter)
        # Ray ships this class to the ingress pickled by value, with its own copy of this module's globals: the
        # registry the ingress reads is the imported module's.
        import exlpy.server.ray_router as registry

        registry.ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

    def _queue_len(self, r: RunningReplica) -> int | None:
        if not self._use_replica_queue_len_cache:
            return None
        return self._replica_queue_len_cache.get(r.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all ranks full: wait, do not spin
        key = policy = None
        if pending_request is not None and pending_request.args:
            key = getattr(pending_request.args[0], "routing_key", None)
            policy = getattr(pending_request.args[0], "policy", None)
        if policy == "rr" and len(candidate_replicas) > 1:
            order = round_robin(self.turn, candidate_replicas)
            self.turn += 1
            return [order[:1], order[1:]]  # the base class skips a full replica, for the least busy other one
        if key is None or len(candidate_replicas) == 1:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        order = rendezvous(key, candidate_replicas)
        first = order[0]
        known = [q for q in (self._queue_len(r) for r in candidate_replicas) if q is not None]
        q_first = self._queue_len(first)
        ranks: list[list[RunningReplica]] = []
        if q_first is None or not known or q_first <= min(known) + self.imbalance:
            ranks.append([first])  # the base class skips it when full (probing it if its length is stale)
        ranks.append(order[1:3])
        if len(order) > 3:
            ranks.append(order[3:])
        return ranks

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each running replica's last routing stats (what its `record_routing_stats` returned), by replica."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self._replicas.items()}
