"""exlpy.model_init (exllamav2's command-line model setup) and exlpy.util."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exlpy import model_init, util
from exlpy.errors import CommandLineError, DeviceError
from tests.conftest import child_env, shared_path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    model_init.add_args(parser)
    return parser.parse_args(list(argv))


def demo() -> str:
    return str(shared_path("models", "aidreams260K"))


def test_flags_set_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("-m", demo(), "-l", "512", "-rs", "2", "-ra", "1.5", "-chunk", "64", "-nfa", "-ng", "-fst")
    model_init.check_args(args)
    model_init.print_options(args)
    out = capsys.readouterr().out
    assert f" -- Model: {demo()}" in out
    assert "'length: 512', 'rope_scale: 2.0', 'rope_alpha: 1.5', 'no_flash_attn', 'no_graphs', 'chunk_size: 64'" \
        in out
    model, tokenizer = model_init.init(args, quiet=True, max_output_len=16)
    c = model.config
    assert model.loaded and tokenizer.bos_token_id == 1
    assert (c.max_seq_len, c.scale_pos_emb, c.scale_alpha_value, c.max_input_len, c.max_attention_size,
            c.max_output_len, c.no_flash_attn, c.no_graphs) == (512, 2.0, 1.5, 64, 64 * 64, 16, True, True)
    assert model.forward(tokenizer.encode("Echoes of", add_bos=True)).shape[-1] == c.vocab_size


def test_low_mem_and_auto_split() -> None:
    args = parse("-m", demo(), "-lm", "-gs", "auto")
    model, _ = model_init.init(args, quiet=True, allow_auto_split=True)
    assert not model.loaded  # -gs auto: the caller creates a lazy cache and calls load_autosplit
    assert model.config.max_input_len == 1024 and model.config.max_attention_size == 1024**2
    with pytest.raises(CommandLineError, match="auto is not allowed"):
        model_init.init(args, quiet=True)


def test_skip_load_then_post_init_load(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("-m", demo())
    model, _ = model_init.init(args, skip_load=True)
    assert not model.loaded
    model_init.post_init_load(model, args, benchmark=True)
    assert model.loaded
    out = capsys.readouterr().out
    assert " -- Loading model..." in out and " -- Loaded model in" in out and " -- Loading tokenizer..." in out


@pytest.mark.parametrize("argv,message", [
    ((), "No model directory specified"),
    (("-m", "/no/such/dir"), "Can't find model directory: /no/such/dir"),
])
def test_check_args_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandLineError, match=message) as e:
        model_init.check_args(parse(*argv))
    assert isinstance(e.value, SystemExit)


def test_check_args_missing_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CommandLineError, match=r"Cannot find tokenizer.model or tokenizer.json in"):
        model_init.check_args(parse("-m", str(tmp_path)))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CommandLineError, match=r"Cannot find \*.safetensors in"):
        model_init.check_args(parse("-m", str(tmp_path)))


@pytest.mark.parametrize("argv,message", [
    (("-ept", "2"), "has no experts"),
    (("-lq4",), "load_in_q4"),
    (("-gs", "abc"), "comma-separated GB per GPU"),
    (("-gs", ",".join(["1"] * 64)), "Too many entries in gpu_split"),
    (("-chunk", "0"), "chunk_size must be >= 1"),
])
def test_bad_flags_are_command_line_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandLineError, match=message):
        model_init.init(parse("-m", demo(), *argv), quiet=True)


def test_command_line_error_exits_with_message_not_traceback(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import argparse\nfrom exlpy import model_init\np = argparse.ArgumentParser()\n"
                      "model_init.add_args(p)\nmodel_init.check_args(p.parse_args())\n")
    r = subprocess.run([sys.executable, str(script), "-m", "/no/such/dir"], capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert r.returncode == 1 and "Can't find model directory: /no/such/dir" in r.stderr
    assert "Traceback" not in r.stderr


# --- util -------------------------------------------------------------------------------------------------------
def test_timer_and_timed(capsys: pytest.CaptureFixture[str]) -> None:
    with util.Timer() as t:
        time.sleep(0.01)
    assert t.interval >= 0.01 and t.end_time - t.start_time == t.interval

    @util.timed
    def work(x: int) -> int:
        return x + 1

    assert work(1) == 2 and work(2) == 3
    assert "work executed in" in capsys.readouterr().out and len(util.timings["work"]) == 2


def test_seq_tensor() -> None:
    s = util.SeqTensor((1, 0), torch.long, seq_dim=-1)
    assert not s and len(s) == 0 and s.seq_cap == 256
    data = torch.arange(300).view(1, -1)
    s.append(data[:, :200])
    s.append(data[:, 200:])  # grows past one page
    assert len(s) == 300 and s.seq_cap == 512 and torch.equal(s.torch(), data)
    assert torch.equal(s.torch_slice(10, 20), data[:, 10:20]) and torch.equal(s.slice(None, 5).torch(), data[:, :5])
    c = s.clone(drop=100)
    s.truncate(50)
    assert len(c) == 200 and torch.equal(c.torch(), data[:, :200]) and len(s) == 50
    s.set(data[:, :3])
    assert torch.equal(s.torch(), data[:, :3])
    assert torch.equal(util.SeqTensor.from_tensor(data, seq_dim=1).torch(), data)
    with pytest.raises(ValueError, match="outside 0..3"):
        s.truncate(4)


def test_integer_split_and_4bit_packing() -> None:
    assert util.integer_split(10, [1, 1, 1]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert sum(util.integer_split(1000, [3, 5, 7], minimum=100)) == 1000
    vals = torch.randint(0, 16, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = util.pack_4bit(vals)
    assert packed.shape == (3, 8) and packed.dtype == torch.int32
    assert torch.equal(util.unpack_4bit(packed), vals)
    with pytest.raises(ValueError, match="multiple of 8"):
        util.pack_4bit(vals[:, :7])


def test_debug_helpers_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    keep = torch.zeros(3, 5, 7)
    assert util.list_live_tensors()["(3, 5, 7), torch.float32, cpu"] >= 1
    util.set_snapshot()
    more = torch.zeros(2, 9, 11)
    new, _ = util.diff_snapshot()
    assert new.get("(2, 9, 11), torch.float32, cpu") == 1
    util.cuda_sync_active()
    util.print_vram_usage()
    assert "Peak memory:" in capsys.readouterr().out
    with util.get_basic_progress() as progress:
        task = progress.add_task("loading", total=2)
        progress.update(task, advance=2)
    del keep, more


def test_gpu_memory_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert util.get_visible_devices() == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    with pytest.raises(DeviceError, match="non-integer"):
        util.get_visible_devices()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_available():
        mem = util.get_all_gpu_memory()
        assert all(set(v) == {"total", "used", "free"} and v["total"] >= v["free"] for v in mem.values())
    else:
        from exlpy.parallel import memory

        # No GPU here: every source is made to fail; the error says which were tried.
        monkeypatch.setattr(memory, "SOURCES", {"nvml": _fail, "torch": _fail, "rocm-smi": _fail})
        with pytest.raises(DeviceError, match="Unable to read available VRAM"):
            util.get_all_gpu_memory()


def _fail() -> list[object]:
    raise RuntimeError("absent")
