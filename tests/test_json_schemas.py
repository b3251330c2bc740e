"""JSON-schema constrained output from SmolLM2: every output parses and validates (`jsonschema`). The suite runs
every seventh of the 50 schemas (8 jobs at once in the dynamic generator) to stay fast on a CPU;
`python -m benchmarks.json_schemas` runs all 50 with a report (benchmarks/results/json_schemas.md: 50/50)."""

from __future__ import annotations

import pytest

from tests.conftest import shared_path

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")


@pytest.mark.slow
def test_schemas_parse_and_validate() -> None:
    import json

    from benchmarks.json_schema_cases import CASES
    from benchmarks.json_schemas import load, run_cases

    assert len(CASES) == 50 and len({json.dumps(c, sort_keys=True) for _, c in CASES}) == 50
    cases = CASES[::7]
    gen = load(str(shared_path("models", "smollm2-135m-exl2-4.0")))
    results = run_cases(gen, cases)
    bad = [(what, r["text"], r.get("error")) for (what, _), r in zip(cases, results) if not r["valid"]]
    assert not bad, bad
