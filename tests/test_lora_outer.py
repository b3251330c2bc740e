"""Adapters that replace or adapt the embedding and the head, against PEFT (fp32 on CPU): modules_to_save
(replaced lm_head / embed_tokens, exllamav2's replacement tensors), LoRA on lm_head and embed_tokens (with the
base_layer copies PEFT saves beside them, which replace the base when they differ), a tied model; rows with
different such adapters in one step (eager and through the step-graph runner's static buffers), the dynamic
generator, and the refusals (two replacements in one slot, tensor parallelism)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.engine.graphs import StepGraphs
from exlpy.errors import LoraConfigError
from exlpy.lora import registry_of
from exlpy.model.batch import cache_rows_batch
from tests.conftest import rel_err, requires_cuda
from tests.hf_models import make_hf_model
from tests.lora_util import peft_adapter

peft = pytest.importorskip("peft")
TOL = 1e-4
HEAD, EMBED = "base_model.model.lm_head", "base_model.model.model.embed_tokens"


def _peft_logits(pm: object, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = pm(ids).logits.float()  # type: ignore[operator]
        with pm.disable_adapter():  # type: ignore[attr-defined]
            base = pm(ids).logits.float()  # type: ignore[operator]
    return out, base


def _perturb_saved(pm: object, path: Path, seed: int) -> None:
    """PEFT copies modules_to_save unchanged: give the copies their own weights (as training would)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():  # type: ignore[attr-defined]
            if "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(str(path))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora_outer")
    ids = torch.randint(3, 320, (2, 11), generator=torch.Generator().manual_seed(0))
    out: dict = {"root": root, "ids": ids, "dir": root / "model"}
    specs = {"saved": dict(targets=["q_proj", "v_proj"], modules_to_save=["lm_head", "embed_tokens"], seed=1),
             "saved2": dict(targets=["o_proj"], modules_to_save=["lm_head"], seed=2),
             "lowrank": dict(targets=["q_proj", "lm_head", "embed_tokens"], seed=3, use_rslora=True),
             "head_only": dict(targets=["lm_head"], seed=4, rank_pattern={"lm_head": 4})}
    for name, spec in specs.items():
        hf = make_hf_model(out["dir"], "llama", dtype=torch.float16)
        pm = peft_adapter(hf, root / name, r=8, alpha=16, **spec)  # type: ignore[arg-type]
        if "modules_to_save" in spec:
            _perturb_saved(pm, root / name, spec["seed"])  # type: ignore[arg-type]
        out[name] = _peft_logits(pm, ids)
    # A LoRA on the head whose saved base layer differs from the model's (PEFT loads it over the base weights).
    import shutil

    import transformers as tf

    shutil.copytree(root / "lowrank", root / "newbase")
    t = load_file(str(root / "newbase" / "adapter_model.safetensors"))
    t[f"{HEAD}.base_layer.weight"] = t[f"{HEAD}.base_layer.weight"] + 0.05 * torch.randn(
        t[f"{HEAD}.base_layer.weight"].shape, generator=torch.Generator().manual_seed(9))
    save_file(t, str(root / "newbase" / "adapter_model.safetensors"))
    hf = tf.LlamaForCausalLM.from_pretrained(str(out["dir"]), torch_dtype=torch.float32).eval()
    pm = peft.PeftModel.from_pretrained(hf, str(root / "newbase"))
    with torch.no_grad():
        out["newbase"] = (pm(ids).logits.float(), None)
    return out


def _model(path: Path) -> ExLlamaV2:
    m = ExLlamaV2(ExLlamaV2Config(str(path)))
    m.load(device="cpu")
    return m


@pytest.mark.parametrize("name", ["saved", "lowrank", "head_only", "newbase"])
def test_equals_peft(case: dict, name: str) -> None:
    m = _model(case["dir"])
    lora = ExLlamaV2Lora.from_directory(m, str(case["root"] / name))
    ref, base = case[name]
    ids = case["ids"]
    plain = m.forward(ids)
    assert rel_err(ref, plain) > 0.05  # the adapter matters
    assert rel_err(m.forward(ids, loras=[lora]), ref) <= TOL
    if base is not None:
        assert rel_err(plain, base) <= TOL  # not applied when not asked for
    cache = ExLlamaV2Cache(m, batch_size=2, max_seq_len=32)  # prefill, then decode through the cache
    chunks = [m.forward(ids[:, :6], cache, loras=[lora])]
    chunks += [m.forward(ids[:, t:t + 1], cache, loras=[lora]) for t in range(6, 11)]
    assert rel_err(torch.cat(chunks, 1), ref) <= TOL
    outer = {k: (w.table is not None, w.rank) for k, w in lora.outer.items()}
    assert outer == {"saved": {"lm_head": (True, 0), "model.embed_tokens": (True, 0)},
                     "lowrank": {"lm_head": (False, 8), "model.embed_tokens": (False, 8)},  # base_layer = model's
                     "head_only": {"lm_head": (False, 4)},
                     "newbase": {"lm_head": (True, 8), "model.embed_tokens": (False, 8)}}[name]
    assert (lora.lm_head is not None) == outer["lm_head"][0]  # exllamav2's attribute


def test_tied_model_replaced_embedding_and_adapted_head(tmp_path: Path) -> None:
    """Tied embeddings: a replaced embed_tokens changes the lookup only (PEFT's copy is not tied to the
    head), a LoRA on lm_head adds to the shared table's logits."""
    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    hf = make_hf_model(tmp_path / "m", "llama", dtype=torch.float16, tie_word_embeddings=True)
    pm = peft_adapter(hf, tmp_path / "ad", r=8, alpha=8, targets=["lm_head", "k_proj"],
                      modules_to_save=["embed_tokens"], seed=5)
    _perturb_saved(pm, tmp_path / "ad", 5)
    ref, base = _peft_logits(pm, ids)
    m = _model(tmp_path / "m")
    assert m.config.spec.features.tied_head and rel_err(m.forward(ids), base) <= TOL
    assert rel_err(m.forward(ids, loras=[ExLlamaV2Lora.from_directory(m, str(tmp_path / "ad"))]), ref) <= TOL
    import json

    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({**cfg, "ensure_weight_tying": True}))
    with pytest.raises(LoraConfigError, match="ensure_weight_tying = true .* not supported for"):
        ExLlamaV2Lora.from_directory(m, str(tmp_path / "ad"))


def _mixed_step(m: ExLlamaV2, loras: list[list[ExLlamaV2Lora] | None], ids: torch.Tensor,
                runner: StepGraphs | None = None) -> torch.Tensor:
    """Each row prefilled with its adapters, then one decode step over all rows (eager or the runner)."""
    cache = ExLlamaV2Cache(m, batch_size=len(loras), max_seq_len=32)
    dev = m.strategy_for_forward().first_device
    reg = registry_of(m)
    slots = [reg.acquire(lr) if lr else -1 for lr in loras]
    try:
        n = ids.shape[1] - 1
        for r, s in enumerate(slots):
            m.forward_batch(ids[r:r + 1, :n], cache_rows_batch(cache, [r], [0], n, dev, [s]), preprocess_only=True)
        if runner is None:
            return m.forward_batch(ids[:, n:], cache_rows_batch(cache, list(range(len(slots))), [n] * len(slots), 1,
                                                                dev, slots))
        out = runner.run_rows(ids[:, n:], cache, [n] * len(slots), None, cache.max_seq_len, adapters=slots,
                              lora=reg.ensure(runner.strategy))
        assert out is not None
        return out
    finally:
        for s in slots:
            reg.release(s)


def test_rows_with_different_outer_adapters_in_one_step(case: dict) -> None:
    """Two replaced heads (two tables), a low-rank head and embedding, a block-only combination and no adapter
    in one decode step: each row equals its forward alone, eagerly and through the graph runner's static
    buffers (run eagerly here: capture=False)."""
    m = _model(case["dir"])
    ad = {k: ExLlamaV2Lora.from_directory(m, str(case["root"] / k)) for k in ("saved", "saved2", "lowrank",
                                                                              "head_only")}
    rows = [["saved"], ["lowrank"], None, ["saved2"], ["saved", "head_only"], ["saved"]]
    loras = [[ad[k] for k in r] if r else None for r in rows]
    ids = torch.randint(3, 320, (len(rows), 8), generator=torch.Generator().manual_seed(2))
    ref = torch.cat([m.forward(ids[r:r + 1], loras=loras[r])[:, -1:] for r in range(len(rows))])
    assert rel_err(_mixed_step(m, loras, ids), ref) <= TOL
    assert registry_of(m).tables["lm_head"] >= 2  # two replaced heads resident at once
    strategy = m.strategy_for_forward()
    assert rel_err(_mixed_step(m, loras, ids, StepGraphs(strategy, capture=False)), ref) <= TOL
    # A layer split (the embedding and the head in different stages, as on two GPUs): their buffers follow.
    from exlpy.engine.split import layer_split
    from exlpy.model import Transformer

    split = StepGraphs(layer_split(Transformer(m.modules), (2, 5)), capture=False)
    assert len(split.strategy.stages) == 3
    assert rel_err(_mixed_step(m, loras, ids, split), ref) <= TOL
    # Against PEFT for the rows whose adapter PEFT computed on these ids' prefix: not available; instead the
    # combination row differs from both of its parts, so both were applied.
    alone = [m.forward(ids[4:5], loras=[ad[k]])[:, -1:] for k in ("saved", "head_only")]
    assert min(rel_err(ref[4:5], a) for a in alone) > 1e-3


def test_two_replacements_in_one_slot_and_unload(case: dict) -> None:
    m = _model(case["dir"])
    a = ExLlamaV2Lora.from_directory(m, str(case["root"] / "saved"))
    b = ExLlamaV2Lora.from_directory(m, str(case["root"] / "saved2"))
    with pytest.raises(LoraConfigError, match="'saved2?' and 'saved2?' both replace lm_head"):
        m.forward(case["ids"], loras=[a, b])
    slot = registry_of(m).slot_for((a,))
    head = m.modules[-1].lora
    assert int(head.table_of[slot]) >= 0
    a.unload()
    assert int(head.table_of[slot]) == -1 and slot not in head.owner  # the table is free for another adapter
    assert rel_err(m.forward(case["ids"], loras=[b]), m.forward(case["ids"])) > 0.01


def test_refused_under_tensor_parallelism(case: dict) -> None:
    m = ExLlamaV2(ExLlamaV2Config(str(case["dir"])))
    m.load_tp([1, 1], devices=["cpu", "cpu"])
    with pytest.raises(LoraConfigError, match="lm_head and model.embed_tokens are not supported under tensor"):
        ExLlamaV2Lora.from_directory(m, str(case["root"] / "saved"))
    with pytest.raises(LoraConfigError, match="adapt lm_head are not supported under tensor"):
        ExLlamaV2Lora.from_directory(m, str(case["root"] / "head_only"))


def test_dynamic_generator_batches_outer_adapters(tmp_path: Path) -> None:
    """On the bundled demo model (tied embeddings, a real tokenizer): jobs whose adapters replace the head or
    adapt the embedding, and one without, decoded together; greedy tokens equal an argmax oracle of full
    forwards with the same adapters."""
    from exlpy import ExLlamaV2Tokenizer
    from exlpy.demo import DEMO_MODEL_DIR
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from tests.lora_util import write_adapter
    from tests.test_generator_helpers import drain
    from tests.test_lora_generators import oracle

    cfg = ExLlamaV2Config(DEMO_MODEL_DIR)
    cfg.max_seq_len = 1024
    m = ExLlamaV2(cfg)
    m.load(device="cpu")
    g = torch.Generator().manual_seed(3)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    head = {f"{q}.lora_A.weight": torch.randn(4, 64, generator=g) * 0.1,
            f"{q}.lora_B.weight": torch.randn(64, 4, generator=g) * 0.1,
            f"{HEAD}.weight": torch.randn(512, 64, generator=g) * 0.1}
    emb = {f"{EMBED}.lora_embedding_A": torch.randn(8, 512, generator=g),
           f"{EMBED}.lora_embedding_B": torch.randn(64, 8, generator=g) * 0.5}
    d = Path(DEMO_MODEL_DIR)
    a = ExLlamaV2Lora.from_directory(m, str(write_adapter(tmp_path / "a", d, r=4, tensors=head, targets=["q_proj"],
                                                          config={"modules_to_save": ["lm_head"]})))
    b = ExLlamaV2Lora.from_directory(m, str(write_adapter(tmp_path / "b", d, r=8, tensors=emb,
                                                          targets=["embed_tokens"])))
    tok = ExLlamaV2Tokenizer(cfg)
    ids = [tok.encode(p, add_bos=True) for p in ("Echoes of", "Once", "The gentle hum of", "Why")]
    sets = [[a], [b], None, [a, b]]
    gen = ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=4 * 256), tok)
    jobs = [ExLlamaV2DynamicJob(i, 8, gen_settings=ExLlamaV2Sampler.Settings.greedy(), stop_conditions=[],
                                loras=s) for i, s in zip(ids, sets)]
    gen.enqueue(jobs)
    res = drain(gen)
    for i, s, j in zip(ids, sets, jobs):
        assert res[j]["tokens"] == oracle(m, i, 8, s), s
    assert gen.decode_tokens == 4 * 8  # every step served all four jobs together
    assert res[jobs[0]]["tokens"] != oracle(m, ids[0], 8, None) != res[jobs[1]]["tokens"]


def _outer_case(device: str, dtype: torch.dtype) -> tuple:
    """Embedding / head slot buffers with two low-rank slots (ranks below the buffer's) and two tables."""
    from exlpy.lora.adapter import OuterWeights
    from exlpy.lora.outer import EMBED, OuterLora

    g = torch.Generator().manual_seed(11)
    V, H = 300, 48

    class _Lora:
        def __init__(self, r: int, table: bool, key: str) -> None:
            a = torch.randn(r, H if key == "lm_head" else V, generator=g)
            b = torch.randn(V if key == "lm_head" else H, r, generator=g) * 0.1
            self.outer = {key: OuterWeights(torch.randn(V, H, generator=g) if table else None, a, b)}

    out = []
    for key in ("lm_head", EMBED):
        o = OuterLora(key, V, H, True, 2, 3, 16, torch.device(device), dtype)
        o.write(0, (_Lora(5, True, key),))
        o.write(2, (_Lora(16, False, key),))
        o.write(1, (_Lora(3, True, key),))
        out.append(o)
    return out


@pytest.mark.interpreter
def test_outer_hooks_triton_equal_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's and the embedding's hooks through the Triton LoRA kernels (interpreter, CPU tensors) equal
    the torch references: the embedding's looked-up u with its scale column, a vocabulary-wide expand."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    from exlpy.kernels import lora as tk
    from exlpy.kernels import ops
    from exlpy.model.batch import ForwardBatch

    head, emb = _outer_case("cpu", torch.float32)
    g = torch.Generator().manual_seed(12)
    adapters = torch.tensor([2, -1, 0, 1, 2])
    T = 3
    batch = ForwardBatch(5, T, torch.zeros(5, T, dtype=torch.long), adapters=adapters, lora=1)
    x = torch.randn(5, T, 48, generator=g)
    y = torch.randn(5, T, 300, generator=g)
    ids = torch.randint(0, 300, (5, T), generator=g)
    h = torch.randn(5, T, 48, generator=g)
    want = head.logits(x, y.clone(), batch), emb.embed(ids, h.clone(), batch)
    monkeypatch.setattr(ops, "_impl", lambda name, t: getattr(tk, name))
    got = head.logits(x, y.clone(), batch), emb.embed(ids, h.clone(), batch)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5
    assert rel_err(want[0][1], y[1]) == 0 and rel_err(want[1][1], h[1]) == 0  # the row without an adapter


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
def test_captured_outer_adapter_steps_cuda(case: dict, dtype: torch.dtype, tol: float) -> None:
    """On a GPU: captured decode steps over rows with replaced / adapted heads and embeddings equal the eager
    steps and the fp32 CPU model."""
    rows = [["saved"], ["lowrank"], None, ["saved2"], ["saved", "head_only"]]
    ids = torch.randint(3, 320, (len(rows), 8), generator=torch.Generator().manual_seed(2))
    cpu = _model(case["dir"])
    ref = _mixed_step(cpu, [[ExLlamaV2Lora.from_directory(cpu, str(case["root"] / k)) for k in r] if r else None
                            for r in rows], ids)
    cfg = ExLlamaV2Config(str(case["dir"]))
    cfg.dtype = dtype
    m = ExLlamaV2(cfg)
    m.load(device="cuda:0")
    if not m.strategy_for_forward().graph_safe:
        pytest.skip("Triton kernels unavailable: graphs are off")
    ad = {k: ExLlamaV2Lora.from_directory(m, str(case["root"] / k)) for k in ("saved", "saved2", "lowrank",
                                                                              "head_only")}
    loras = [[ad[k] for k in r] if r else None for r in rows]
    graphed = _mixed_step(m, loras, ids).float().cpu()
    runner = m.strategy.graph_cache.get("runner")
    assert runner is not None and any(k[-1] for k in runner.steps)  # a captured step that ran the adapters
    m.config.no_graphs = True
    eager = _mixed_step(m, loras, ids).float().cpu()
    m.config.no_graphs = False
    assert rel_err(graphed, eager) <= 2e-3 and rel_err(graphed, ref) <= tol
