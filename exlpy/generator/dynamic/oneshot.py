"""`ExLlamaV2DynamicGenerator.generate`: one call that turns prompts into completions through the job queue."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob


def generate(self: Any, prompt: str | tuple[str, str] | list[Any], max_new_tokens: int, min_new_tokens: int = 0,
             seed: int | None = None, gen_settings: Any = None, token_healing: bool = False,
             encode_special_tokens: bool = False, decode_special_tokens: bool = False,
             stop_conditions: Iterable[int | str] | None = None, add_bos: bool = False,
             abort_event: threading.Event | None = None, completion_only: bool = False,
             filters: list[Any] | None = None, filter_prefer_eos: bool = False,
             return_last_results: bool = False, embeddings: Any = None,
             banned_strings: list[str] | None = None, **kwargs: Any) -> Any:
    """Generate for one prompt (str) or a batch (list); returns text (or a list), plus the final results
    when `return_last_results`. A failing job raises its error here."""
    single = isinstance(prompt, (str, tuple))
    prompts = [prompt] if single else list(prompt)
    settings = gen_settings if isinstance(gen_settings, list) else [gen_settings] * len(prompts)
    # Filters hold per-sequence state: a batch takes one list of filters per prompt.
    per_prompt_filters = filters if (filters and not single and isinstance(filters[0], list)) else None
    jobs = []
    for i, p in enumerate(prompts):
        texts = list(p) if isinstance(p, tuple) else [p]  # a tuple is a CFG pair (positive, negative)
        ids = [self.tokenizer.encode(t, add_bos=add_bos, encode_special_tokens=encode_special_tokens)
               for t in texts]
        jobs.append(ExLlamaV2DynamicJob(
            ids if len(ids) > 1 else ids[0], max_new_tokens, min_new_tokens, gen_settings=settings[i],
            token_healing=token_healing, seed=None if seed is None else seed + i,
            stop_conditions=stop_conditions, decode_special_tokens=decode_special_tokens,
            filters=per_prompt_filters[i] if per_prompt_filters else filters,
            filter_prefer_eos=filter_prefer_eos, identifier=i, banned_strings=banned_strings,
            embeddings=embeddings))
    self.enqueue(jobs)
    completions = [""] * len(prompts)
    last: list[dict[str, Any] | None] = [None] * len(prompts)
    while any(not j.finished for j in jobs):
        if abort_event is not None and abort_event.is_set():
            for j in jobs:
                if not j.finished:
                    self.cancel(j)
            break
        for r in self.iterate():
            if r["stage"] != "streaming" or r["job"] not in jobs:
                continue
            i = r["identifier"]
            completions[i] += r.get("text", "")
            if r["eos"]:
                if "error" in r:
                    raise r["error"]
                last[i] = r
    texts = [c if completion_only else (p[0] if isinstance(p, tuple) else p) + c
             for p, c in zip(prompts, completions)]
    out: Any = texts[0] if single else texts
    if return_last_results:
        return out, (last[0] if single else last)
    return out
