"""`exlpy eval`: exllamav2's test_inference.py workflows (perplexity, cache perplexity, speed sweeps) on the
aidreams260K model (CPU, seconds)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from exlpy.errors import CalibrationDataError
from exlpy.eval import dataset_rows, decode_speed, perplexity, perplexity_token_by_token, prefill_lengths, prefill_speed
from tests.test_generator_helpers import aidreams


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text of the kind the model was trained on: its own greedy continuation of its favourite opening."""
    from exlpy import ExLlamaV2Cache
    from exlpy.generator import ExLlamaV2DynamicGenerator, ExLlamaV2Sampler

    model, tok = aidreams()
    gen = ExLlamaV2DynamicGenerator(model, ExLlamaV2Cache(model, max_seq_len=256), tok)
    text = gen.generate("Echoes of", 110, gen_settings=ExLlamaV2Sampler.Settings.greedy(), add_bos=True,
                        stop_conditions=[])
    p = tmp_path_factory.mktemp("eval") / "data.txt"
    p.write_text(text)
    return p


def test_perplexity_matches_a_direct_computation_and_the_token_by_token_pass(dataset: Path) -> None:
    model, tok = aidreams()
    ids = dataset_rows(str(dataset), tok, rows=2, length=48)
    assert ids.shape == (2, 48) and ids[0].tolist() == tok.encode(dataset.read_text())[0, :48].tolist()
    r = perplexity(model, ids)
    nll = []
    for row in ids:
        lp = torch.log_softmax(model.forward(row[None])[0, :-1].float(), -1)
        nll.append(-lp.gather(-1, row[1:, None].to(lp.device)).mean().cpu())
    assert r.tokens == 2 * 47 and r.perplexity == pytest.approx(math.exp(float(torch.stack(nll).mean())), rel=1e-4)
    assert 1.0 < r.perplexity < 20  # a trained model on text of its kind (uniform guessing: 512)
    # One token at a time through an fp16 cache gives the same (fp32 on the CPU); Q4 stays close.
    row = perplexity(model, ids[:1]).perplexity
    assert perplexity_token_by_token(model, ids[:1], "fp16").perplexity == pytest.approx(row, rel=1e-3)
    q4 = perplexity_token_by_token(model, ids[:1, :24], "q4").perplexity
    assert q4 == pytest.approx(perplexity(model, ids[:1, :24]).perplexity, rel=0.1)
    with pytest.raises(CalibrationDataError, match="evaluation dataset"):
        dataset_rows(str(dataset) + ".missing", tok, 2, 48)
    with pytest.raises(CalibrationDataError, match="-er/-el"):
        dataset_rows(str(dataset), tok, 500, 2048)


def test_speed_sweeps() -> None:
    assert prefill_lengths(1024) == list(range(128, 1025, 128))
    assert prefill_lengths(20000)[8:] == [2048, 3072, 4096, 8192, 12288, 16384]
    model, tok = aidreams()
    assert [n for n, _ in prefill_speed(model, 256, runs=1)] == [128, 256]
    windows = list(decode_speed(model, tok, 80, window=32))
    assert [(a, b) for a, b, _ in windows] == [(2, 31), (32, 63), (64, 79)]
    assert all(tps > 0 for *_, tps in windows)


def test_cli(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from exlpy.cli.main import main

    model_dir = str(aidreams()[0].config.model_dir)
    assert main(["eval", "ppl", "-m", model_dir, "-ed", str(dataset), "-er", "1", "-el", "32", "-eq8"]) == 0
    out = capsys.readouterr().out
    assert "Evaluation perplexity:" in out and "token by token, Q8 cache:" in out
    assert main(["eval", "speed", "-m", model_dir, "-l", "256", "-ps"]) == 0
    assert "Length    256 tokens" in capsys.readouterr().out
    assert main(["eval", "speed", "-m", model_dir]) == 1  # neither -ps nor -s: a typed error, status 1
