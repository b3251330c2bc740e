"""JSON-schema constrained output from SmolLM2 for 50 different schemas: every output parses and validates
(`jsonschema`). All 50 jobs run at once in the dynamic generator (benchmarks/json_schemas.py is the same run
with a report)."""

from __future__ import annotations

import pytest

from tests.conftest import shared_path

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")


@pytest.mark.slow
def test_fifty_schemas_parse_and_validate() -> None:
    from benchmarks.json_schema_cases import CASES
    from benchmarks.json_schemas import load, run_cases

    assert len(CASES) == 50
    gen = load(str(shared_path("models", "smollm2-135m-exl2-4.0")))
    results = run_cases(gen, CASES)
    bad = [(what, r["text"], r.get("error")) for (what, _), r in zip(CASES, results) if not r["valid"]]
    assert not bad, bad
