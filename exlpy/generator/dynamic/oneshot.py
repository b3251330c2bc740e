"""`ExLlamaV2DynamicGenerator.generate()`: one call that enqueues a job per prompt and iterates until all end."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from exlpy.errors import GeneratorError
from exlpy.generator.dynamic.job import ExLlamaV2DynamicJob

if TYPE_CHECKING:
    from exlpy.generator.dynamic.generator import ExLlamaV2DynamicGenerator


def _one_prompt(p: Any) -> bool:
    return isinstance(p, str) or (isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p))


def run_generate(gen: ExLlamaV2DynamicGenerator, prompt: str | tuple[str, str] | list[Any], max_new_tokens: int,
                 min_new_tokens: int, seed: int | None, gen_settings: Any, token_healing: bool,
                 encode_special_tokens: bool, decode_special_tokens: bool,
                 stop_conditions: Iterable[int | str] | None, add_bos: bool, abort_event: threading.Event | None,
                 completion_only: bool, filters: list[Any] | None, filter_prefer_eos: bool,
                 return_last_results: bool, embeddings: Any, banned_strings: list[str] | None) -> Any:
    single = _one_prompt(prompt)
    if not single and not (isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt)):
        raise GeneratorError(f"generate(): prompt must be a string, a (positive, negative) pair of strings for CFG, "
                             f"or a non-empty list of them, got {prompt!r:.60}")
    prompts = [prompt] if single else list(prompt)
    settings = gen_settings if isinstance(gen_settings, list) else [gen_settings] * len(prompts)
    per_prompt_filters = _per_prompt_filters(filters, len(prompts), single)
    jobs = []
    embs = check_aliases(embeddings, [t for p in prompts for t in (p if isinstance(p, tuple) else [p])])
    for i, p in enumerate(prompts):
        texts = list(p) if isinstance(p, tuple) else [p]  # a tuple is a CFG pair (positive, negative)
        # Each prompt's ids hold the embeddings whose aliases it contains (every alias is in some prompt).
        used = [e for e in embs if any(e.text_alias in t for t in texts)]
        ids = [gen.tokenizer.encode(t, add_bos=add_bos, encode_special_tokens=encode_special_tokens,
                                    embeddings=[e for e in used if e.text_alias in t] or None)
               for t in texts]
        jobs.append(ExLlamaV2DynamicJob(
            ids if len(ids) > 1 else ids[0], max_new_tokens, min_new_tokens, gen_settings=settings[i],
            token_healing=token_healing, seed=None if seed is None else seed + i,
            stop_conditions=stop_conditions, decode_special_tokens=decode_special_tokens,
            filters=per_prompt_filters[i] if per_prompt_filters is not None else filters,
            filter_prefer_eos=filter_prefer_eos, identifier=i, banned_strings=banned_strings,
            embeddings=used or None))
    gen.enqueue(jobs)
    completions = [""] * len(prompts)
    last: list[dict[str, Any] | None] = [None] * len(prompts)
    while any(not j.finished for j in jobs):
        if abort_event is not None and abort_event.is_set():
            for j in jobs:
                if not j.finished:
                    gen.cancel(j)
            break
        for r in gen.iterate():
            if r["stage"] != "streaming" or r["job"] not in jobs:
                continue
            i = r["identifier"]
            completions[i] += r.get("text", "")
            if r["eos"]:
                if "error" in r:
                    for j in jobs:  # the call fails as a whole: its other jobs stop and free their pages
                        if not j.finished:
                            gen.cancel(j)
                    raise r["error"]
                last[i] = r
    texts = [c if completion_only else (p[0] if isinstance(p, tuple) else p) + c
             for p, c in zip(prompts, completions)]
    out: Any = texts[0] if single else texts
    if return_last_results:
        return out, (last[0] if single else last)
    return out


def check_aliases(embeddings: Any, texts: list[str]) -> list[Any]:
    """The embeddings of a generate() call, each alias present in at least one prompt (MultimodalError)."""
    from exlpy.errors import MultimodalError
    from exlpy.vision.embedding import check_embeddings

    embs = check_embeddings(embeddings)
    for e in embs:
        if not any(e.text_alias in t for t in texts):
            raise MultimodalError(f"generate(): the alias {e.text_alias!r} of an embedding passed in embeddings= "
                                  "appears in no prompt; put each image's text_alias in the prompt")
    return embs


def _per_prompt_filters(filters: list[Any] | None, n: int, single: bool) -> list[Any] | None:
    """Filters hold per-sequence state, so a batch takes one entry per prompt: a list of filters, or None to
    leave that prompt unfiltered (exllamav2's examples/inference_lmfe.py). A flat list of filter objects is
    shared by every prompt. None when `filters` is not per prompt."""
    if single or not filters or not any(f is None or isinstance(f, (list, tuple)) for f in filters):
        return None
    if len(filters) != n:
        raise GeneratorError(f"generate(): filters has {len(filters)} entries for {n} prompts; give one list of "
                             "filters (or None) per prompt")
    return [list(f) if isinstance(f, (list, tuple)) else ([] if f is None else [f]) for f in filters]
