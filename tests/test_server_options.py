"""`exlpy serve`'s loading options and YAML config file (TabbyAPI's key names, flags over the file): parsing,
errors naming the key, and that each option reaches the library (cache kind, RoPE, split, TP, prompt template,
draft model, adapters) on the demo model and a tiny random model on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("yaml")

from fastapi.testclient import TestClient  # noqa: E402

from exlpy import ExLlamaV2  # noqa: E402
from exlpy.cli.main import build_parser, main  # noqa: E402
from exlpy.cli.serve import options_from_args  # noqa: E402
from exlpy.demo import DEMO_MODEL_DIR  # noqa: E402
from exlpy.errors import ConfigError  # noqa: E402
from exlpy.generator import ExLlamaV2Sampler  # noqa: E402
from exlpy.server import create_app, load_state  # noqa: E402
from exlpy.server.config_file import flatten  # noqa: E402
from exlpy.server.loading import load_generator  # noqa: E402
from exlpy.server.options import ModelOptions, model_options  # noqa: E402
from tests.lora_util import write_adapter  # noqa: E402
from tests.test_server_helpers import CHAT_TEMPLATE, single_torch_thread  # noqa: E402, F401  (autouse fixture)
from tests.tp_util import make_model_dir  # noqa: E402

TABBY_SAMPLE = """
network:
  host: 0.0.0.0
  port: 5000
  disable_auth: false
  disable_fetch_requests: false
  send_tracebacks: false
  api_servers: ["OAI"]
logging:
  log_prompt: false
  log_generation_params: false
  log_requests: false
model:
  model_dir: {root}
  inline_model_loading: false
  use_dummy_models: false
  dummy_model_names: ["gpt-3.5-turbo"]
  model_name: demo
  use_as_default: []
  backend:
  max_seq_len: 96
  tensor_parallel: false
  gpu_split_auto: true
  autosplit_reserve: [96]
  gpu_split: []
  rope_scale: 1.0
  rope_alpha:
  cache_mode: Q6
  cache_size: 1024
  chunk_size: 512
  max_batch_size: 4
  prompt_template:
  vision: false
draft_model:
  draft_model_dir: {root}
  draft_model_name:
  draft_rope_scale: 1.0
  draft_rope_alpha:
  draft_cache_mode: FP16
  draft_gpu_split: []
lora:
  lora_dir: loras
  loras:
embeddings:
  embedding_model_dir: models
  embeddings_device: cpu
  embedding_model_name:
sampling:
  override_preset:
developer:
  unsafe_launch: false
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shutil.copytree(DEMO_MODEL_DIR, tmp_path / "demo")
    return tmp_path


def _parse(*argv: str) -> tuple[Any, list[str]]:
    return options_from_args(build_parser().parse_args(["serve", *argv]))


def test_tabbyapi_sample_config_loads_quietly(root: Path) -> None:
    cfg = root / "config.yml"
    cfg.write_text(TABBY_SAMPLE.format(root=root))
    opts, warnings = _parse("--config", str(cfg))
    assert warnings == []  # every value is TabbyAPI's default or implemented
    m = opts.model
    assert (opts.access.host, opts.access.port, opts.access.disable_auth) == ("0.0.0.0", 5000, False)
    assert m.model_dir == str(root / "demo") and m.name == "demo" and opts.models_root == str(root)
    assert (m.max_seq_len, m.cache_mode, m.cache_size, m.chunk_size, m.max_batch_size) == (96, "Q6", 1024, 512, 4)
    assert (m.rope_scale, m.rope_alpha, m.gpu_split, m.autosplit_reserve, m.draft) == (1.0, None, None, (96,), None)
    # Flags override the file; a --model replaces the file's model_name.
    other = root / "other"
    shutil.copytree(DEMO_MODEL_DIR, other)
    opts, _ = _parse("--config", str(cfg), "--port", "9000", "--cache-mode", "q8", "--max-seq-len", "64",
                     "--model", str(other), "--rope-alpha", "2.5")
    assert (opts.access.port, opts.model.cache_mode, opts.model.max_seq_len) == (9000, "Q8", 64)
    assert opts.model.model_dir == str(other) and opts.model.rope_alpha == 2.5
    assert opts.model.cache_size == 1024 and opts.access.host == "0.0.0.0"


def test_config_errors_name_the_key(root: Path) -> None:
    for text, match in (("model:\n  max_seq_lenn: 5\n", "unknown key 'model.max_seq_lenn'"),
                        ("modle:\n  max_seq_len: 5\n", "unknown section 'modle'"),
                        ("model: 3\n", "section 'model' must be a mapping"),
                        ("- a\n", "top level must be a mapping"),
                        ("model:\n  cache_mode: Q3\n", r"model.cache_mode\) must be one of FP16, Q8, Q6, Q4"),
                        ("model:\n  max_seq_len: -4\n", r"model.max_seq_len\) must be a positive integer"),
                        ("model:\n  max_seq_len: '4096'\n", "max_seq_len. must be a positive integer"),
                        ("model:\n  gpu_split: [20, x]\n", "--gpu-split \\(model.gpu_split\\): .x. is not a number"),
                        ("model:\n  model_name: ../../etc\n", "must be the name of a directory inside"),
                        ("model:\n  model_name: demo\n", "no model.model_dir is set"),
                        ("model:\n  gpu_split_auto: true\n  gpu_split: [20]\n", "set gpu_split_auto: false"),
                        ("network:\n  disable_auth: 'yes'\n", "disable_auth must be true or false"),
                        ("network:\n  port: 70000\n", "port must be in"),
                        ("lora:\n  loras: [{name: a, scale: 2}]\n", "lora.loras\\[0\\]"),
                        ("model: [\n", "not valid YAML")):
        cfg = root / "c.yml"
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=match):
            _parse("--config", str(cfg))
    with pytest.raises(ConfigError, match="cannot be read"):
        _parse("--config", str(root / "missing.yml"))


def test_unimplemented_tabbyapi_keys_warn(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values, warnings = flatten({"model": {"vision": True, "backend": "exllamav3", "use_dummy_models": True},
                                "developer": {"cuda_malloc_backend": True}, "logging": {"log_prompt": True}})
    assert values == {"vision": True}  # TabbyAPI's vision switch is honoured (exlpy/vision/)
    text = "\n".join(warnings)
    for key in ("model.backend", "model.use_dummy_models", "developer.cuda_malloc_backend", "logging.log_prompt"):
        assert key in text
    assert "model.vision" not in text and len(warnings) == 4
    # The CLI prints them and goes on (here it then fails on a missing model dir, after the warnings).
    cfg = root / "c.yml"
    cfg.write_text(f"model:\n  backend: exllamav3\n  model_dir: {root}\n  model_name: absent\n")
    assert main(["serve", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "warning:" in err and "model.backend" in err and "absent does not exist" in err


def _greedy(gen: Any, prompt: str, n: int = 8) -> str:
    return gen.generate(prompt, max_new_tokens=n, gen_settings=ExLlamaV2Sampler.Settings.greedy(), add_bos=True)


def test_cache_mode_and_rope_reach_the_model() -> None:
    gen, _ = load_generator(ModelOptions(cache_mode="Q4", rope_scale=2.0, rope_alpha=1.5, max_seq_len=64,
                                         cache_size=512, max_batch_size=3), warmup=False)
    assert type(gen.cache).__name__ == "ExLlamaV2Cache_Q4" and gen.num_pages == 2 and gen.max_batch_size == 3
    cfg = gen.model.config
    assert (cfg.scale_pos_emb, cfg.scale_alpha_value, cfg.max_seq_len) == (2.0, 1.5, 64)
    base, _ = load_generator(ModelOptions(max_seq_len=64, cache_size=512), warmup=False)
    assert type(base.cache).__name__ == "ExLlamaV2Cache"
    # Different RoPE, different logits (the override is applied, not only stored).
    ids = base.tokenizer.encode("Once upon a time", add_bos=True)
    assert not torch.allclose(gen.model.forward(ids), base.model.forward(ids), atol=1e-3)


def test_gpu_split_goes_to_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    # One entry more than there are GPUs (none on a CPU machine): the library refuses a split for devices that do
    # not exist, and says so (a split that fits would start serving).
    n = torch.cuda.device_count()
    assert main(["serve", "--gpu-split", ",".join(["20"] * (n + 1))]) == 1
    assert f"gpu_split: {n + 1} entries for {n} visible CUDA device" in capsys.readouterr().err
    assert main(["serve", "--gpu-split", "20,x"]) == 1
    assert "'x' is not a number" in capsys.readouterr().err


def test_tensor_parallel_serving_matches_one_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_model_dir(tmp_path / "tp", vocab=512)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEMO_MODEL_DIR) / f, d / f)
    single, _ = load_generator(ModelOptions(model_dir=str(d), max_seq_len=128, cache_size=512), warmup=False)
    expect = _greedy(single, "Once upon")
    single.model.unload()
    real = ExLlamaV2.load_tp
    # Without GPUs, two TP slots on the CPU (the library's test hook), as the TP tests do.
    monkeypatch.setattr(ExLlamaV2, "load_tp", lambda self, *a, **k: real(self, *a, devices=["cpu", "cpu"], **k))
    gen, _ = load_generator(model_options({"model": str(d), "tensor_parallel": True, "gpu_split": "1,1",
                                           "max_seq_len": 128, "cache_size": 512, "cache_mode": "Q8"}),
                            warmup=False)
    assert type(gen.cache).__name__ == "ExLlamaV2Cache_TP" and gen.cache.base.__name__ == "ExLlamaV2Cache_Q8"
    gen.model.unload()
    gen, _ = load_generator(model_options({"model": str(d), "tensor_parallel": True, "gpu_split": "1,1",
                                           "max_seq_len": 128, "cache_size": 512}), warmup=False)
    assert len(gen.model.tp_context.all_devices()) == 2
    assert _greedy(gen, "Once upon") == expect


def test_prompt_template_file_and_name(root: Path) -> None:
    tmpl = root / "t.jinja"
    tmpl.write_text("{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}")
    state = load_state(options=ModelOptions(prompt_template=str(tmpl), cache_size=512), warmup=False)
    with TestClient(create_app(state)) as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        text = c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert "<<user|hi>>" in text
    # A name picks one of the model's own templates (tokenizer_config.json's list of {name, template}).
    tc_path = root / "demo" / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = [{"name": "default", "template": CHAT_TEMPLATE},
                           {"name": "terse", "template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}]
    tc_path.write_text(json.dumps(tc))
    gen, _ = load_generator(ModelOptions(model_dir=str(root / "demo"), prompt_template="terse", cache_size=512),
                            warmup=False)
    assert gen.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    for bad, match in (("nope", "neither a file nor a template of the model"),
                       (str(root / "no.jinja"), "no such file")):
        with pytest.raises(ConfigError, match=match):
            load_generator(ModelOptions(model_dir=str(root / "demo"), prompt_template=bad), warmup=False)
    broken = root / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(Exception, match="does not parse"):
        load_generator(ModelOptions(prompt_template=str(broken)), warmup=False)


def test_draft_model_and_loras_from_the_config_file(root: Path) -> None:
    write_adapter(root / "loras" / "poet", Path(DEMO_MODEL_DIR), r=4, seed=1, std=0.3)
    cfg = root / "c.yml"
    cfg.write_text(f"model:\n  model_dir: {root}\n  model_name: demo\n  cache_size: 512\n"
                   f"draft_model:\n  draft_model_dir: {root}\n  draft_model_name: demo\n  draft_cache_mode: Q8\n"
                   f"lora:\n  lora_dir: {root / 'loras'}\n  loras: [{{name: poet, scaling: 0.5}}]\n")
    opts, _ = _parse("--config", str(cfg))
    assert opts.model.draft is not None and opts.model.draft.cache_mode == "Q8"
    assert opts.model.loras[0].scaling == 0.5 and opts.loras_root == str(root / "loras")
    state = load_state(options=opts.model, warmup=False)
    g = state.generator
    assert g.draft_model is not None and type(g.draft_cache).__name__ == "ExLlamaV2Cache_Q8"
    # exllamav2 stores the user's scale times alpha / r (16 / 4 here)
    assert list(state.adapters) == ["poet"] and state.adapters["poet"].lora_scaling == 0.5 * 16 / 4
    with TestClient(create_app(state)) as c:
        r = c.post("/v1/completions", json={"model": "poet", "prompt": "Once", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "poet"
    with pytest.raises(ConfigError, match="alternatives"):
        _parse("--config", str(cfg), "--ngram-draft")
