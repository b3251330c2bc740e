"""Layer streaming (`load(lazy=True)`, `exlpy eval ppl -sl`): the model runs with each module loaded just
before it runs and freed after. On CPU: the same logits as a normal load through every forward entry (with and
without a cache, parallel blocks included), at most two modules resident, the dynamic generator, the
layer-major perplexity pass, a load failure midway, the refusals; on a GPU (marker `gpu`): the same logits
with the weights never all resident."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exlpy import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Lora
from exlpy.errors import LoraConfigError, ModelStateError
from tests.arch_models import VOCAB, make_arch_model
from tests.conftest import rel_err, requires_cuda
from tests.lora_util import write_adapter

TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "cohere"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("stream") / request.param
    if request.param == "llama":
        from tests.hf_models import make_hf_model

        make_hf_model(d, "llama", dtype=torch.float16)
    else:
        make_arch_model(d, "cohere")  # parallel blocks: the MLP reads the attention's normed input
    return d


def _load(path: Path, lazy: bool) -> ExLlamaV2:
    m = ExLlamaV2(ExLlamaV2Config(str(path)))
    m.load(device="cpu", lazy=lazy)
    return m


def test_streamed_forward_equals_a_normal_load(model_dir: Path) -> None:
    ref, m = _load(model_dir, False), _load(model_dir, True)
    assert m.loaded and m.strategy_for_forward().name == "streaming"
    assert all(x.device is None for x in m.modules)  # lazy: devices assigned, nothing loaded
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    want = ref.forward(ids)
    assert rel_err(m.forward(ids), want) <= TOL
    n = len(m.modules)
    assert m.stream.loads == n and m.stream.peak_resident <= 2  # each module once, one ahead at most
    assert all(x.device is None for x in m.modules)  # freed after the pass
    assert rel_err(m.forward(ids, last_id_only=True), want[:, -1:]) <= TOL
    logits, state = m.forward(ids, return_last_state=True)
    assert rel_err(state, ref.forward(ids, return_last_state=True)[1]) <= TOL
    # Through a cache: a prefill (which stops after the last attention), then decode steps.
    cache = ExLlamaV2Cache(m, batch_size=2, max_seq_len=32)
    loads = m.stream.loads
    assert m.forward(ids[:, :7], cache, preprocess_only=True) is None
    assert m.stream.loads - loads == n - 3  # no final norm or head, and the MLP after the last attention
    assert all(x.device is None for x in m.modules)  # its prefetched successor was freed too
    steps = [m.forward(ids[:, t:t + 1], cache) for t in range(7, 12)]
    assert rel_err(torch.cat(steps, 1), want[:, 7:]) <= TOL
    m.unload()
    assert not m.loaded and m.stream is None
    with pytest.raises(ModelStateError, match="not loaded"):
        m.forward(ids)


def test_long_input_in_chunks(model_dir: Path) -> None:
    """An input longer than max_input_len goes through a cache in chunks, layer-major (each module read once
    for all chunks, every chunk of a layer reading the cache rows the chunks before it wrote)."""
    cfg = ExLlamaV2Config(str(model_dir))
    cfg.max_input_len, cfg.max_attention_size = 8, 64
    m = ExLlamaV2(cfg)
    m.load(device="cpu", lazy=True)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = ExLlamaV2Cache(m, max_seq_len=64)
    assert rel_err(m.forward(ids, cache), _load(model_dir, False).forward(ids)) <= TOL
    assert m.stream.loads == len(m.modules)  # many chunks, run layer-major: each module read once


def test_dynamic_generator_on_a_streamed_model() -> None:
    """The dynamic generator (paged cache, jobs batched together) gives a normal load's tokens."""
    from exlpy import ExLlamaV2Tokenizer
    from exlpy.demo import DEMO_MODEL_DIR
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler
    from tests.test_generator_helpers import drain

    outs = []
    for lazy in (False, True):
        cfg = ExLlamaV2Config(DEMO_MODEL_DIR)
        m = ExLlamaV2(cfg)
        m.load(device="cpu", lazy=lazy)
        tok = ExLlamaV2Tokenizer(cfg)
        gen = ExLlamaV2DynamicGenerator(m, ExLlamaV2Cache(m, max_seq_len=512), tok)
        jobs = [ExLlamaV2DynamicJob(tok.encode(p, add_bos=True), 8, gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                                    stop_conditions=[]) for p in ("Once upon", "The little dog")]
        gen.enqueue(jobs)
        res = drain(gen)
        outs.append([res[j]["tokens"] for j in jobs])
    assert outs[0] == outs[1]


def test_load_failure_midway_frees_everything(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _load(model_dir, True)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    want = m.forward(ids)
    victim = m.modules[3]
    real = type(victim).load

    def broken(self: object, device: torch.device) -> None:
        if self is victim:
            raise OSError("disk went away")
        real(self, device)  # type: ignore[arg-type]

    monkeypatch.setattr(type(victim), "load", broken)
    with pytest.raises(OSError, match="disk went away"):
        m.forward(ids)
    assert all(x.device is None for x in m.modules)
    monkeypatch.undo()
    assert rel_err(m.forward(ids), want) <= TOL  # the model still works


def test_refusals(model_dir: Path, tmp_path: Path) -> None:
    m = _load(model_dir, True)
    if m.config.spec.arch.parallel_blocks:
        pytest.skip("LoRA is refused for Cohere's blocks anyway")
    with pytest.raises(LoraConfigError, match="layer streaming"):
        ExLlamaV2Lora.from_directory(m, str(write_adapter(tmp_path / "a", model_dir, r=4)))
    with pytest.raises(ModelStateError, match="already loaded"):
        m.load(device="cpu")
    from exlpy.engine.streaming import stream_rows

    with pytest.raises(ModelStateError, match="load\\(lazy=True\\)"):
        stream_rows(_load(model_dir, False), torch.zeros(1, 4, dtype=torch.long), 2, lambda a, y: None)


def test_layer_major_perplexity_equals_the_plain_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """exllamav2's -sl: every row through one module before the next is read (each module loaded once),
    the same perplexity as one forward per row; and through `exlpy eval ppl -sl`."""
    from exlpy.cli.main import main
    from exlpy.demo import DEMO_MODEL_DIR
    from exlpy.eval import perplexity, perplexity_streamed

    ids = torch.randint(3, 512, (5, 24), generator=torch.Generator().manual_seed(3))
    ref = perplexity(_load(Path(DEMO_MODEL_DIR), False), ids)
    m = _load(Path(DEMO_MODEL_DIR), True)
    seen: list[int] = []
    r = perplexity_streamed(m, ids, rows_per_pass=2, progress=lambda done, total: seen.append(done))
    assert r.perplexity == pytest.approx(ref.perplexity, rel=1e-5) and r.tokens == ref.tokens == 5 * 23
    assert m.stream.loads == len(m.modules) and seen == [2, 4, 5]
    assert all(x.device is None for x in m.modules)
    data = tmp_path / "d.txt"
    data.write_text("Once upon a time there was a little girl who loved the sea. " * 8)
    assert main(["eval", "ppl", "-m", DEMO_MODEL_DIR, "-ed", str(data), "-er", "2", "-el", "32"]) == 0
    plain = capsys.readouterr().out.split("Evaluation perplexity:")[1].split()[0]
    assert main(["eval", "ppl", "-m", DEMO_MODEL_DIR, "-ed", str(data), "-er", "2", "-el", "32", "-sl"]) == 0
    streamed = capsys.readouterr().out.split("Evaluation perplexity (streamed):")[1].split()[0]
    assert float(streamed) == pytest.approx(float(plain), rel=1e-4)
    assert main(["eval", "ppl", "-m", DEMO_MODEL_DIR, "-ed", str(data), "-sl", "-eq4"]) == 1


@requires_cuda
@pytest.mark.gpu
def test_streaming_on_gpu_keeps_few_layers_resident(tmp_path: Path) -> None:
    """On a GPU: streamed logits equal a normal load's, and the memory a streamed forward holds stays well
    below the weights of the whole model (two modules at a time, plus the activations)."""
    from tests.tp_util import make_model_dir

    d = make_model_dir(tmp_path / "m", hidden=1024, heads=8, kv_heads=4, head_dim=128, intermediate=4096,
                       vocab=3000, layers=8, dtype=torch.float16, seed=1)
    ids = torch.randint(3, 3000, (1, 64), generator=torch.Generator().manual_seed(4))
    full = ExLlamaV2(ExLlamaV2Config(str(d)))
    full.load()
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    want = full.forward(ids).float().cpu()
    # the same cached steps on the resident model: fp16 incremental logits differ from a full pass in the last bits
    full_cache = ExLlamaV2Cache(full, max_seq_len=128)
    full.forward(ids[:, :60], full_cache, preprocess_only=True)
    want_steps = torch.cat([full.forward(ids[:, t:t + 1], full_cache).float().cpu() for t in range(60, 64)], 1)
    del full_cache
    full.unload()
    torch.cuda.empty_cache()
    # what the process keeps after an unload (per-device kernel workspaces, rotary tables) is not the lazy load's
    before = torch.cuda.memory_allocated()
    m = ExLlamaV2(ExLlamaV2Config(str(d)))
    m.load(lazy=True)
    assert m.devices() == [torch.device("cuda:0")] and torch.cuda.memory_allocated() - before < weights / 8
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = m.forward(ids).float().cpu()
    peak = torch.cuda.max_memory_allocated() - base
    assert rel_err(got, want) <= 2e-3
    assert peak < 0.5 * weights, (peak, weights)
    cache = ExLlamaV2Cache(m, max_seq_len=128)  # the cache stays resident; the layers stream around it
    steps = [m.forward(ids[:, :60], cache, preprocess_only=True)] + [m.forward(ids[:, t:t + 1], cache)
                                                                    for t in range(60, 64)]
    assert rel_err(torch.cat([s.float().cpu() for s in steps[1:]], 1), want_steps) <= 2e-3
    m.unload()
