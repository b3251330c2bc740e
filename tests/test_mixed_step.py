"""The mixed pass (issue 29): prompt chunks inside the decode step, one forward over the decode rows and the chunks'
tokens (model/batch.py `mixed_batch`, model/attention.py `attend_mixed`), against the two-pass path (the decode
step, then each chunk as a pass of its own) on the fp32 CPU model: the same K/V and logits (relative error
< 1e-4), and the same tokens, token for token, from a dynamic generator through arrivals, shared prefixes, stop
conditions, preemption and a failing prompt."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from exlpy import ExLlamaV2Cache, ExLlamaV2Cache_Q4
from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
from exlpy.model.batch import mixed_batch, paged_batch
from exlpy.runtime import RuntimeOptions
from tests.test_dynamic_overlap import PoisonedModel  # a pass holding the poison token id raises
from tests.test_generator_helpers import aidreams_cpu as aidreams
from tests.test_generator_helpers import argmax_tokens

GREEDY = ExLlamaV2Sampler.Settings.greedy()
TOP_P = ExLlamaV2Sampler.Settings(temperature=1.1, top_k=0, top_p=0.9, token_repetition_penalty=1.0)
CPU = torch.device("cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- the model: one mixed pass against the two passes ------------------------------------------------------------
def check_one_pass_against_two(model: Any, cache_kind: Any, vocab: int = 500) -> None:
    """Two decode rows, a chunk deep into a prompt and one from its start (pages scattered in the cache), and a
    decode row of the chunk's own sequence at the chunk's end (a prompt finished in this pass: its row must see the
    chunk's K/V, written in the same pass), the decode rows padded to 4 as the generator pads them."""
    page = 16
    g = torch.Generator().manual_seed(5)
    ids = {k: torch.randint(3, vocab, (80,), generator=g) for k in "ABCD"}
    pages = {"A": [3, 7, 1], "B": [5], "C": [0, 9, 2, 11], "D": [4, 6]}
    past = {"A": 37, "B": 5, "C": 20, "D": 0}

    def prefilled() -> Any:
        cache = cache_kind(model, max_seq_len=page * 16)
        for k in "ABC":
            b = paged_batch([(pages[k], 0, past[k])], cache, CPU, page)
            model.forward_batch(ids[k][:past[k]].view(1, -1), b, preprocess_only=True)
        return cache

    decode = [(pages["A"], 37, 1), (pages["B"], 5, 1)]
    chunks = {"C": (pages["C"], 20, 25), "D": (pages["D"], 0, 31)}
    # two passes: the chunks, then the decode step (with the row at C's end, position 45)
    two = prefilled()
    for k, (p, s, n) in chunks.items():
        model.forward_batch(ids[k][s:s + n].view(1, -1), paged_batch([(p, s, n)], two, CPU, page),
                            preprocess_only=True)
    rows = decode + [(pages["C"], 45, 1)]
    step = torch.stack([ids["A"][37:38], ids["B"][5:6], ids["C"][45:46]])
    ref = model.forward_batch(step, paged_batch(rows, two, CPU, page), last_id_only=True)[:, -1]
    # one pass
    one = prefilled()
    batch = mixed_batch([rows, [chunks["C"]], [chunks["D"]]], one, CPU, page, len(rows), (4, 4))
    x = torch.cat([step.view(-1), torch.tensor([0]), ids["C"][20:45], ids["D"][0:31]]).view(1, -1)
    out = model.forward_batch(x, batch, last_id_only=True)
    assert out.shape == (1, 3, ref.shape[-1])
    assert rel(out[0], ref) < 1e-4
    for a, b in zip(one.all_tensors(), two.all_tensors()):
        if a.is_floating_point():
            assert rel(a.float(), b.float()) < 1e-4
        else:  # quantized codes: a rounding flip moves one code by one step at most
            assert (a.int() - b.int()).abs().max() <= 1


@pytest.mark.parametrize("cache_kind", [ExLlamaV2Cache, ExLlamaV2Cache_Q4])
def test_mixed_pass_writes_the_same_kv_and_gives_the_same_logits(cache_kind: Any) -> None:
    check_one_pass_against_two(aidreams()[0], cache_kind)


# Sliding windows and soft-capped scores (Gemma 2), parallel blocks and windowed layers (Cohere 2), learned
# positions read from the pass's positions (GPT-2), mixture-of-experts blocks over the pass's tokens (Mixtral).
@pytest.mark.parametrize("case", ["gemma2", "cohere2", "gpt2", "mixtral"])
def test_mixed_pass_on_other_architectures(tmp_path: Path, case: str) -> None:
    from exlpy import ExLlamaV2, ExLlamaV2Config
    from tests.arch_models import VOCAB, make_arch_model

    make_arch_model(tmp_path, case, vocab_size=VOCAB)
    config = ExLlamaV2Config(str(tmp_path))
    config.max_seq_len = 256
    model = ExLlamaV2(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load(device="cpu")
    check_one_pass_against_two(model, ExLlamaV2Cache, VOCAB)


def test_mixed_batch_layout() -> None:
    """Positions and cache slots of every token end to end; per segment its rows' positions, lengths and pages."""
    model, _ = aidreams()
    cache = ExLlamaV2Cache(model, max_seq_len=64)
    b = mixed_batch([[([2], 3, 1), ([0, 1], 9, 1)], [([3], 4, 3)]], cache, CPU, 16, 2)
    assert (b.batch_size, b.q_len, b.logit_rows) == (1, 5, 2)
    assert b.positions.tolist() == [[3, 9, 4, 5, 6]]
    assert b.slots.tolist() == [[35, 9, 52, 53, 54]]
    dec, chunk = b.segments
    assert (dec.start, dec.batch.batch_size, dec.batch.q_len) == (0, 2, 1)
    assert dec.batch.seqlens.tolist() == [4, 10] and dec.batch.block_table.tolist() == [[2, 0], [0, 1]]
    assert (chunk.start, chunk.batch.q_len, chunk.batch.positions.tolist()) == (2, 3, [[4, 5, 6]])
    assert chunk.batch.seqlens.tolist() == [7] and chunk.batch.max_seqlen == 7
    # the decode rows padded to a captured step's shape: 4 rows, tables 4 pages wide, keys bounded by the capacity
    b = mixed_batch([[([2], 3, 1), ([0, 1], 9, 1)], [([3], 4, 3)]], cache, CPU, 16, 2, (4, 4))
    dec, chunk = b.segments
    assert (b.q_len, chunk.start, dec.batch.batch_size, dec.batch.max_seqlen) == (7, 4, 4, 64)
    assert b.positions.tolist() == [[3, 9, 0, 0, 4, 5, 6]] and b.slots.tolist() == [[35, 9, -1, -1, 52, 53, 54]]
    assert dec.batch.seqlens.tolist() == [4, 10, 0, 0] and dec.batch.block_table.tolist()[1] == [0, 1, 0, 0]


# --- the generator: mixed against two passes, token for token -----------------------------------------------------
def make_gen(mixed: bool, pages: int = 64, on: Any = aidreams, **kw: Any) -> ExLlamaV2DynamicGenerator:
    model, tok = on()
    kw.setdefault("page_size", 16)
    kw.setdefault("max_chunk_size", 32)
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=pages * kw["page_size"]), tok, **kw)
    gen.mixed_step = mixed
    return gen


def prompt(n: int, seed: int, prefix: torch.Tensor | None = None) -> torch.Tensor:
    ids = torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))
    ids[0, 0] = 1
    if prefix is not None:
        ids[0, :prefix.numel()] = prefix
    return ids


def run(gen: ExLlamaV2DynamicGenerator, arrivals: list[tuple[int, dict[str, Any]]]) -> tuple[list[dict[str, Any]],
                                                                                             dict[Any, torch.Tensor]]:
    """Enqueue each job at its iteration and run to the end; per job (in arrival order) its tokens, text and end
    reason; and the logits every decode step computed, by (job, tokens before it)."""
    logits: dict[Any, torch.Tensor] = {}
    sample = gen.stepper.sample

    def recording(step: Any) -> Any:
        for job, first, epoch in zip(step.jobs, step.first, step.epochs):
            if not job.finished and job.epoch == epoch:
                logits[(job.serial, len(job.sequence) + job.inflight)] = step.logits[first].clone()
        return sample(step)

    gen.stepper.sample = recording  # type: ignore[method-assign]
    jobs: list[ExLlamaV2DynamicJob] = []
    out: dict[Any, dict[str, Any]] = {}
    i = 0
    while i <= max(at for at, _ in arrivals) or gen.num_remaining_jobs():
        for at, kw in arrivals:
            if at == i:
                kw = dict(kw)
                kw.setdefault("gen_settings", GREEDY)
                kw.setdefault("stop_conditions", [])
                jobs.append(ExLlamaV2DynamicJob(**kw))
                gen.enqueue(jobs[-1])
        for r in gen.iterate():
            a = out.setdefault(r["job"], {"tokens": [], "text": "", "eos_reason": None, "error": None})
            if r["stage"] == "streaming":
                a["tokens"] += r["token_ids"][0].tolist()
                a["text"] += r["text"]
                if r["eos"]:
                    a["eos_reason"], a["error"] = r.get("eos_reason"), r.get("error_message")
        i += 1
    assert gen.page_table.num_unreferenced() == gen.num_pages  # every page back
    return [out[j] for j in jobs], logits


def compare(arrivals: list[tuple[int, dict[str, Any]]], tol: float = 1e-4, exact: bool = True,
            **kw: Any) -> tuple[list[dict[str, Any]], Any, Any]:
    """Both paths on the same arrivals: the same tokens, text and end reasons, decode logits within `tol`. Not
    `exact` (fp16 on a GPU: a near tie may go either way): tokens equal up to where they first differ, which must
    not be a job's first token, and the logits compared only before that point."""
    two_gen, one_gen = make_gen(False, **kw), make_gen(True, **kw)
    forward, raised = one_gen.stepper.forward, []

    def watched(*args: Any) -> Any:  # a mixed pass that raised falls back to two passes: none may here
        try:
            return forward(*args)
        except Exception as e:
            raised.append(e)
            raise

    one_gen.stepper.forward = watched  # type: ignore[method-assign]
    two, two_logits = run(two_gen, arrivals)
    one, one_logits = run(one_gen, arrivals)
    assert not raised
    assert two_gen.mixed_steps == 0 and one_gen.mixed_steps > 0
    if not exact:
        keys = []
        for serial, (a, b) in enumerate(zip(one, two)):
            same = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                        min(len(a["tokens"]), len(b["tokens"])))
            assert same > 0, f"job {serial}: first tokens differ"
            first = min(k[1] for k in two_logits if k[0] == serial)
            keys += [k for k in two_logits if k[0] == serial and k[1] < first + same]
        worst = max(rel(one_logits[k].float(), two_logits[k].float()) for k in keys)
        assert worst < tol, f"logits relative error {worst:.3g}"
        return two, two_gen, one_gen
    if not one_gen.preemptions:  # (a job preempted for pages loses its planned chunk unrun in a mixed step)
        assert one_gen.prefill_tokens == two_gen.prefill_tokens
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]
    assert [r["eos_reason"] for r in one] == [r["eos_reason"] for r in two]
    assert [r["text"] for r in one] == [r["text"] for r in two]
    assert one_logits.keys() == two_logits.keys()
    worst = max(rel(one_logits[k], two_logits[k]) for k in two_logits)
    assert worst < tol, f"logits relative error {worst:.3g}"
    return two, two_gen, one_gen


def test_arrivals_next_to_decoding_jobs_match_the_two_pass_path() -> None:
    """Jobs arriving while others decode: prompts of 5 to 150 tokens (a 150-token one spans five 32-token chunks,
    two arrive together and share chunks' iterations), one job finishing early, one sampled with a seed, a CFG job
    (two sequences whose prompts end in different steps); the greedy ones also match the full-forward oracle."""
    model, _ = aidreams()
    arrivals = [(0, {"input_ids": prompt(9, 1), "max_new_tokens": 40}),
                (0, {"input_ids": prompt(14, 2), "max_new_tokens": 6}),  # ends while the long prompts prefill
                (2, {"input_ids": prompt(150, 3), "max_new_tokens": 12}),
                (3, {"input_ids": prompt(70, 4), "max_new_tokens": 10}),
                (3, {"input_ids": prompt(5, 5), "max_new_tokens": 10, "gen_settings": TOP_P, "seed": 11}),
                (4, {"input_ids": [prompt(60, 40), prompt(45, 41)], "max_new_tokens": 8,  # CFG: two sequences
                     "gen_settings": ExLlamaV2Sampler.Settings.greedy(cfg_scale=2.0)}),
                (9, {"input_ids": prompt(40, 6), "max_new_tokens": 8})]
    two, _, one_gen = compare(arrivals)
    assert one_gen.mixed_steps >= 5
    for (_, kw), r in zip(arrivals, two):
        if "seed" not in kw and "gen_settings" not in kw:
            assert r["tokens"] == argmax_tokens(model, kw["input_ids"], kw["max_new_tokens"])


def test_shared_prefixes_and_stop_conditions_match_the_two_pass_path() -> None:
    """Prompts sharing a 48-token prefix (three full pages) that arrive together, and later (its pages then
    cached); stop tokens and stop strings that end jobs mid-way."""
    model, tok = aidreams()
    base = prompt(48, 7)
    shared = [prompt(60, 8, base), prompt(75, 9, base), prompt(52, 10, base)]
    # stop conditions met mid-way: a token and a piece of text from each job's own greedy continuation
    cont = [argmax_tokens(model, p, 12) for p in shared[:2]]
    stop_token = next(t for k, t in enumerate(cont[0]) if k >= 4 and t not in cont[0][:k])
    text = tok.decode(torch.tensor(cont[1]))
    stop_text = text[len(text) // 2:len(text) // 2 + 3]
    arrivals = [(0, {"input_ids": prompt(11, 12), "max_new_tokens": 30}),
                (1, {"input_ids": shared[0], "max_new_tokens": 12, "stop_conditions": [stop_token]}),
                (1, {"input_ids": shared[1], "max_new_tokens": 12, "stop_conditions": [stop_text]}),
                (8, {"input_ids": shared[2], "max_new_tokens": 8})]
    two, two_gen, one_gen = compare(arrivals)
    assert two[1]["eos_reason"] == "stop_token" and two[2]["eos_reason"] == "stop_string"
    assert one_gen.cached_tokens > 0 and one_gen.cached_tokens == two_gen.cached_tokens


def test_preemption_while_a_chunk_waits_for_the_step() -> None:
    """A cache too small for every job: the newest job is preempted for a decoding job's page after its chunk was
    planned for the step; that chunk must not run (its pages went to another job) and the job resumes later."""
    model, _ = aidreams()
    arrivals = [(0, {"input_ids": prompt(6, 20), "max_new_tokens": 30}),
                (0, {"input_ids": prompt(7, 21), "max_new_tokens": 30}),
                (2, {"input_ids": prompt(40, 22), "max_new_tokens": 10}),
                (3, {"input_ids": prompt(30, 23), "max_new_tokens": 10})]
    two, two_gen, one_gen = compare(arrivals, pages=8, page_size=8, max_chunk_size=16)
    assert one_gen.preemptions > 0
    for (_, kw), r in zip(arrivals, two):
        assert r["tokens"] == argmax_tokens(model, kw["input_ids"], kw["max_new_tokens"])


def test_a_crowd_fills_one_mixed_pass_and_the_rest_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts arriving together next to a decoding job: the decode step carries at most `max_chunk_size` prompt
    tokens (the activations the server sizes for), the other chunks of the iteration run as passes of their own."""
    from exlpy.generator.dynamic import prefill

    alone: list[int] = []
    run_chunk = prefill.run_chunk
    monkeypatch.setattr(prefill, "run_chunk", lambda gen, c: (alone.append(c.end - c.start), run_chunk(gen, c)))
    arrivals = [(0, {"input_ids": prompt(6, 50), "max_new_tokens": 20})]
    arrivals += [(2, {"input_ids": prompt(40 + k, 51 + k), "max_new_tokens": 5}) for k in range(3)]
    _, two_gen, one_gen = compare(arrivals)
    ran_alone = sum(alone) - two_gen.prefill_tokens  # the two-pass run's chunks all ran alone
    assert 0 < ran_alone < one_gen.prefill_tokens - 5  # (the first job's prompt ran before anyone decoded)
    assert one_gen.mixed_steps >= 2


def test_a_failing_prompt_chunk_fails_its_job_alone() -> None:
    """A prompt whose third chunk raises: the mixed pass that carries it falls back to two passes, the job ends
    with the error, the decoding jobs keep their exact tokens."""
    model, tok = aidreams()
    poison = 499
    bad = prompt(100, 30)
    bad[bad == poison] = 3
    bad[0, 70] = poison
    gen = ExLlamaV2DynamicGenerator(PoisonedModel(model, poison), ExLlamaV2Cache(model, max_seq_len=1024), tok,
                                    page_size=16, max_chunk_size=32)
    gen.mixed_step = True
    arrivals = [(0, {"input_ids": prompt(8, 31), "max_new_tokens": 16}),
                (2, {"input_ids": bad, "max_new_tokens": 8})]
    out, _ = run(gen, arrivals)
    assert out[1]["eos_reason"] == "error" and "poisoned" in out[1]["error"]
    assert out[0]["tokens"] == argmax_tokens(model, arrivals[0][1]["input_ids"], 16)
    assert gen.mixed_steps >= 2  # its first two chunks went in mixed passes


def test_runtime_switch() -> None:
    assert RuntimeOptions.from_env({}).mixed_step is False  # opt-in: eager, it lost to captured chunks on an H100
    assert RuntimeOptions.from_env({"EXLPY_MIXED_STEP": "1"}).mixed_step is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_step_on_the_gpu_kernels() -> None:
    """The same arrivals on the GPU (fp16, Triton kernels: the decode kernel for the decode rows and the flash kernel
    for the chunks, on slices of one pass; the pure decode steps captured): logits within fp16 rounding of the
    two-pass path, greedy tokens the same until a near tie."""
    from tests.test_generator_helpers import aidreams as on_gpu

    assert on_gpu()[0].strategy_for_forward().first_device.type == "cuda"
    arrivals = [(0, {"input_ids": prompt(9, 1), "max_new_tokens": 24}),
                (0, {"input_ids": prompt(14, 2), "max_new_tokens": 6}),
                (2, {"input_ids": prompt(150, 3), "max_new_tokens": 8}),
                (3, {"input_ids": prompt(70, 4), "max_new_tokens": 8})]
    compare(arrivals, tol=2e-2, exact=False, on=on_gpu)


def test_segments_start_aligned_like_batches_of_their_own() -> None:
    """Each segment's metadata starts on a 16-byte boundary (Triton specializes kernels on pointer alignment)."""
    model, _ = aidreams()
    cache = ExLlamaV2Cache(model, max_seq_len=64)
    b = mixed_batch([[([2], 3, 1)], [([3], 4, 3)], [([1, 0], 9, 2)]], cache, CPU, 16, 1)  # odd-sized parts
    assert b.positions.data_ptr() % 16 == 0
    for seg in b.segments:
        assert seg.batch.positions.data_ptr() % 16 == 0
    assert [s.batch.positions.tolist() for s in b.segments] == [[[3]], [[4, 5, 6]], [[9, 10]]]
    assert b.segments[2].batch.block_table.tolist() == [[1, 0]] and b.slots.tolist() == [[35, 52, 53, 54, 25, 26]]


def test_mixed_pass_under_tensor_parallelism() -> None:
    """Two tensor-parallel lanes (CPU): each runs the pass over its heads and its part of the cache."""
    from exlpy import ExLlamaV2, ExLlamaV2Cache_TP, ExLlamaV2Config
    from tests.conftest import shared_path

    model = ExLlamaV2(ExLlamaV2Config(str(shared_path("models", "tiny-llama-fp16"))))
    model.load_tp([1, 1], devices=["cpu", "cpu"])
    check_one_pass_against_two(model, ExLlamaV2Cache_TP, 512)


def test_mixed_batch_moves_to_another_device_with_its_segments() -> None:
    """A layer split or a TP lane on another device takes the batch with `on()`: the segments go along."""
    model, _ = aidreams()
    cache = ExLlamaV2Cache(model, max_seq_len=64)
    b = mixed_batch([[([2], 3, 1), ([0, 1], 9, 1)], [([3], 4, 3)]], cache, CPU, 16, 2, (4, 2))
    moved = b.on(torch.device("meta"))
    assert moved.positions.device.type == "meta" and moved.slots.shape == (1, 7) and moved.block_table is None
    assert moved.logit_rows == 2 and [s.start for s in moved.segments] == [0, 4]
    for s, t in zip(moved.segments, b.segments):
        assert s.batch.positions.device.type == "meta" and s.batch.block_table.device.type == "meta"
        assert (s.batch.batch_size, s.batch.q_len, s.batch.max_seqlen) == (t.batch.batch_size, t.batch.q_len,
                                                                           t.batch.max_seqlen)
        assert s.batch.block_table.shape == t.batch.block_table.shape
