"""LoRA adapters of dynamic-generator jobs (exlpy/lora/): which adapters a job uses, its adapter slot while it
runs, and the salt that keeps its cached pages apart from other adapters' (a page's K/V depends on the
adapters that computed it, so prefix sharing happens only between jobs with the same adapters)."""

from __future__ import annotations

import hashlib
from typing import Any

from exlpy.errors import ExlpyError, LoraCapacityError


def resolve(generator: Any, job: Any) -> None:
    """At enqueue: the job's adapters (its own `loras`, else the generator's `set_loras`), checked."""
    chosen = job.loras if job.loras is not None else getattr(generator, "current_loras", [])
    job.lora_key = normalize(chosen, generator.model)
    job.lora_salt = salt(job.lora_key)


def salt(key: tuple[Any, ...]) -> bytes | None:
    if not key:
        return None
    return hashlib.blake2b(b"lora" + b"".join(lora.uid for lora in key), digest_size=16).digest()


def normalize(loras: Any, model: Any) -> tuple[Any, ...]:
    from exlpy.lora.slots import normalize as _normalize

    return _normalize(loras, model)


def admit(generator: Any, job: Any, results: list[dict[str, Any]]) -> bool | None:
    """Hold an adapter slot for a job about to start: True when it has one (or needs none); False while every
    slot serves other running jobs (it waits); None when it cannot run (e.g. its adapter was unloaded while it
    was queued): it then ends with an error result."""
    if not job.lora_key:
        return True
    from exlpy.lora.slots import registry_of

    try:
        job.lora_slot = registry_of(generator.model).acquire(job.lora_key, generator.model)
    except LoraCapacityError:
        job.wait_reason = "every LoRA adapter slot serves other running jobs"
        return False
    except ExlpyError as e:
        generator.pending.remove(job)
        generator.fail(job, e, results)
        return None
    return True


def free_slot(generator: Any, job: Any) -> None:
    if job.lora_slot >= 0:
        from exlpy.lora.slots import registry_of

        registry_of(generator.model).release(job.lora_slot)
        job.lora_slot = -1
