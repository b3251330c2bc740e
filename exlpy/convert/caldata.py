"""Calibration token rows: the built-in mixed set (data/), or the user's parquet, text or jsonl file (-c).

Every source becomes one token stream, cut into rows of `length` tokens. Ids at or above the model's vocabulary
are set to 0 (spec §4.2). Rows are made once per job and saved with it, so a resumed job uses the same tokens.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

import torch

from exlpy.errors import CalibrationDataError

SEED = 69420
# Built-in mixture: (source, share of rows). A source that runs short hands its rows to the next ones.
MIXTURE = (("prose", 0.40), ("chat", 0.20), ("code", 0.18), ("multilingual", 0.18), ("random", 0.04))


def _data(name: str) -> str:
    return resources.files("exlpy.convert").joinpath("data").joinpath(name).read_text(encoding="utf-8")


def _dialogues(tokenizer: Any) -> list[str]:
    convs = []
    for name in ("chat.jsonl", "chat_docs.jsonl"):
        convs += [json.loads(line)["messages"] for line in _data(name).splitlines() if line.strip()]
    has_template = bool(getattr(tokenizer, "tokenizer_config", {}).get("chat_template"))
    out = []
    for msgs in convs:
        text = None
        if has_template:
            try:
                text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - templates that reject a role (system) fall back to plain turns
                text = None
        if text is None:
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs)
        out.append(text)
    return out


def _stream(tokenizer: Any, source: str) -> list[int]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and tokenizer.bos_token_id >= 0 else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None and tokenizer.eos_token_id >= 0 else []
    if source == "chat":
        ids: list[int] = []
        for text in _dialogues(tokenizer):
            ids += tokenizer.encode(text, encode_special_tokens=True)[0].tolist() + eos
        return ids
    if source == "code":
        return bos + tokenizer.encode(_data("code.txt"))[0].tolist()
    docs = _data(f"{source}.txt").split("\n\n\n" if source == "prose" else "\n\n")
    ids = []
    for d in docs:
        ids += bos + tokenizer.encode(d)[0].tolist() + eos
    return ids


def _shares(rows: int) -> list[int]:
    raw = [rows * p for _, p in MIXTURE]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: counts[i] - raw[i])[:rows - sum(counts)]:
        counts[i] += 1
    return counts


def builtin_rows(tokenizer: Any, rows: int, length: int, vocab_size: int) -> torch.Tensor:
    """[rows, length] int64 from the built-in mixture."""
    if tokenizer is None:
        raise CalibrationDataError("the built-in calibration set needs the model's tokenizer (tokenizer.json or "
                                   "tokenizer.model) in the source directory; add it or give -c with a jsonl "
                                   "file of pre-tokenized rows ({\"input_ids\": [...]} per line)")
    gen = torch.Generator().manual_seed(SEED)
    want = _shares(rows)
    pools: dict[str, list[torch.Tensor]] = {}
    for name, _ in MIXTURE:
        if name == "random":
            continue
        ids = torch.tensor(_stream(tokenizer, name), dtype=torch.long)
        n = ids.numel() // length
        pools[name] = list(ids[:n * length].view(n, length)) if n else []
    out: list[torch.Tensor] = []
    short = 0
    for (name, _), count in zip(MIXTURE, want):
        if name == "random":
            out += list(torch.randint(0, vocab_size, (count, length), generator=gen))
            continue
        take = pools[name][:count]
        pools[name] = pools[name][count:]
        short += count - len(take)
        out += take
    for name, _ in MIXTURE:  # spill-over
        while short and pools.get(name):
            out.append(pools[name].pop(0))
            short -= 1
    if short:
        raise CalibrationDataError(f"the built-in calibration set holds only {rows - short} rows of {length} "
                                   f"tokens for this tokenizer, {rows} asked: lower -r/-mr or -l/-ml, or give "
                                   "your own data with -c")
    return torch.stack(out)


def _read_parquet(path: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CalibrationDataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or give the "
                                   "calibration text as .txt or .jsonl") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise CalibrationDataError(f"{path}: not a readable parquet file: {e}") from e
    cols = table.to_pydict()
    n = table.num_rows
    # exllamav2 joins all columns of a row with spaces, rows concatenated.
    return [" ".join(str(cols[c][i]) for c in cols) for i in range(n)]


def _read_jsonl(path: str, text: str) -> tuple[list[str], list[list[int]]]:
    texts, ids = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("input_ids"), list):
            ids.append([int(t) for t in obj["input_ids"]])
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            texts.append(obj["text"])
        elif isinstance(obj, str):
            texts.append(obj)
        else:
            raise CalibrationDataError(f"{path}:{lineno}: each line must be a string or an object with a "
                                       "\"text\" string or an \"input_ids\" list")
    return texts, ids


def file_rows(path: str, tokenizer: Any, rows: int, length: int, vocab_size: int) -> torch.Tensor:
    """[rows, length] int64: the first rows*length tokens of the file (spec §4.2)."""
    if not os.path.isfile(path):
        raise CalibrationDataError(f"calibration file not found: {path}")
    ids: list[int] = []
    try:
        if path.endswith(".parquet"):
            texts, pre = _read_parquet(path), []
        else:
            with open(path, encoding="utf-8") as f:
                raw = f.read()
            texts, pre = _read_jsonl(path, raw) if path.endswith(".jsonl") else ([raw] if raw.strip() else [], [])
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationDataError(f"{path}: cannot read the calibration file: {e}") from e
    for p in pre:
        ids += p
    if texts:
        if tokenizer is None:
            raise CalibrationDataError(f"{path} holds text but the source model has no tokenizer; give rows of "
                                       "token ids ({\"input_ids\": [...]} per jsonl line)")
        ids += tokenizer.encode("\n\n".join(texts))[0].tolist()
    if not ids:
        raise CalibrationDataError(f"{path}: the calibration file is empty")
    need = rows * length
    if len(ids) < need:
        raise CalibrationDataError(f"{path}: holds {len(ids)} tokens, but {rows} rows of {length} tokens need "
                                   f"{need}: give more text or lower -r/-l (-mr/-ml for measurement)")
    return torch.tensor(ids[:need], dtype=torch.long).view(rows, length)


def calibration_rows(path: str | None, tokenizer: Any, rows: int, length: int, vocab_size: int) -> torch.Tensor:
    t = builtin_rows(tokenizer, rows, length, vocab_size) if path is None else file_rows(
        path, tokenizer, rows, length, vocab_size)
    return torch.where((t >= vocab_size) | (t < 0), torch.zeros_like(t), t)


def open_tokenizer(model_dir: str) -> Any:
    """The source model's tokenizer, or None when it has none."""
    from exlpy.errors import TokenizerError
    from exlpy.tokenizer import ExLlamaV2Tokenizer

    try:
        return ExLlamaV2Tokenizer(model_dir)
    except TokenizerError:
        return None
