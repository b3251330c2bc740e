"""exlpy's metrics over the replicas of a Ray Serve application (exlpy/server/ray_app.py).

Each replica's `record_routing_stats` returns its own Prometheus text (exlpy/server/metrics.py); Ray polls it
every `request_routing_stats_period_s` and gives it to the request router of the ingress, which serves:

- `GET /metrics`: the cluster's totals, one series per metric and label set summed over the replicas
  (counters, gauges, histogram buckets, sums and counts), `exlpy:kv_cache_usage_perc` recomputed from the summed
  pages, and `exlpy:replicas` (replicas reporting). A Prometheus scrape of the ingress sees the whole
  deployment; the figures are at most one stats period old.
- `GET /metrics/replicas`: every replica's series with a `replica` label (its Serve replica id, the same as the
  `x-exlpy-replica` response header).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

USAGE = "exlpy:kv_cache_usage_perc"
PAGES_USED, PAGES_TOTAL = "exlpy:cache_pages_used", "exlpy:cache_pages_total"


@dataclass
class Family:
    name: str
    kind: str
    doc: str
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


def _families(texts: Mapping[str, str], replica_label: bool) -> dict[str, Family]:
    """The families of all texts, their samples summed over texts (or kept apart under a `replica` label)."""
    out: dict[str, Family] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            f = out.setdefault(fam.name, Family(fam.name, fam.type, fam.documentation))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue  # a creation time: neither summed nor meaningful across processes
                labels = dict(s.labels)
                if replica_label:
                    labels["replica"] = replica
                key = (s.name, tuple(sorted(labels.items())))
                f.samples[key] = f.samples.get(key, 0.0) + float(s.value)
    return out


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _render(families: Mapping[str, Family]) -> str:
    lines = []
    for f in families.values():
        if not f.samples:
            continue  # e.g. the `_created` family the parser makes of a counter's creation times
        lines.append(f"# HELP {f.name} {f.doc}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        for (name, labels), v in f.samples.items():
            lab = ",".join(f'{k}="{_escape(str(x))}"' for k, x in labels)
            lines.append(f"{name}{{{lab}}} {_value(v)}" if lab else f"{name} {_value(v)}")
    return "\n".join(lines) + "\n"


def summed(texts: Mapping[str, str]) -> str:
    """The replicas' metrics (replica id -> Prometheus text) as the cluster's totals."""
    fams = _families(texts, replica_label=False)
    used = fams.get(PAGES_USED)
    total = fams.get(PAGES_TOTAL)
    if USAGE in fams and used is not None and total is not None:
        u = sum(used.samples.values())
        t = sum(total.samples.values())
        fams[USAGE].samples = {(USAGE, ()): u / t if t else 0.0}
    fams["exlpy:replicas"] = Family("exlpy:replicas", "gauge", "Replicas whose metrics are summed here",
                                    {("exlpy:replicas", ()): float(len(texts))})
    return _render(fams)


def per_replica(texts: Mapping[str, str]) -> str:
    """The replicas' metrics side by side, each series labelled with its replica."""
    return _render(_families(texts, replica_label=True))
