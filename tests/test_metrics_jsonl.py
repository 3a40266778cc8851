"""Run files (metrics.jsonl, summary.json) are strict JSON whatever number types they hold."""

import json
import math

import numpy as np

from decoupled_diloco import report
from decoupled_diloco.metrics import JsonlWriter, read_jsonl, write_json


def _strict(text: str):
    """json.loads refusing NaN and Infinity, as every JSON parser but Python's does."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_values_are_strs_at_any_depth_and_of_any_number_type(tmp_path):
    """A float nan was written "nan", but a np.float32 one, an array's inf and a nested
    list's or dict's were written NaN and Infinity, which jq, pandas and browsers refuse."""
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(str(path))
    rows = [
        {"loss": math.nan},
        {"loss": np.float32("nan"), "grad_norm": np.float64("-inf")},
        {"norms": np.array([1.0, np.inf]), "losses": [math.inf, 2.0]},
        {"this_attempt": {"bytes": math.inf, "per/learner": (np.float32(-np.inf),)}},
    ]
    for row in rows:
        writer.write(row)
    writer.close()
    lines = path.read_text().splitlines()
    got = [_strict(line) for line in lines]
    assert got == [
        {"loss": "nan"},
        {"loss": "nan", "grad_norm": "-inf"},
        {"norms": [1.0, "inf"], "losses": ["inf", 2.0]},
        {"this_attempt": {"bytes": "inf", "per/learner": ["-inf"]}},
    ]
    assert math.isnan(report.number(read_jsonl(path)[1]["loss"]))  # read back as a float


def test_a_retained_file_and_a_summary_stay_strict_json(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": [Infinity]}\n')  # older files
    writer = JsonlWriter(str(path))
    assert writer.retain(lambda r: True) == 0
    writer.close()
    assert [_strict(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": "nan"},
        {"step": 2, "loss": ["inf"]},
    ]
    write_json(str(tmp_path / "summary.json"), {"eval": {"loss": np.float32("nan")}, "n": 3})
    assert _strict((tmp_path / "summary.json").read_text()) == {"eval": {"loss": "nan"}, "n": 3}
