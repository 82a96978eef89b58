"""JSON as strict readers take it, written whole (``files``): one conversion for a profile's record and a result
document, nested or flat."""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from opsd_rollout.files import json_safe, write_json_atomic


def test_non_finite_numbers_become_null_at_any_depth_and_scalars_plain_numbers():
    value = {"a": math.nan, "b": [1.5, -math.inf, (2, math.inf)], "c": {"d": torch.tensor(3), "e": np.float32(0.5)},
             "f": torch.tensor(float("nan")), "g": "text", "h": None, "i": True}
    assert json_safe(value) == {"a": None, "b": [1.5, None, [2, None]], "c": {"d": 3, "e": 0.5}, "f": None,
                                "g": "text", "h": None, "i": True}
    assert type(json_safe(value)["c"]["d"]) is int


def test_a_document_is_written_whole_as_strict_json(tmp_path):
    path = tmp_path / "sub" / "result.json"
    write_json_atomic(path, {"results": [{"summary": {"p50": math.nan, "max": 2.0}}]})
    text = path.read_text()
    assert json.loads(text, parse_constant=lambda word: 1 / 0) == {"results": [{"summary": {"p50": None, "max": 2.0}}]}
    assert text.endswith("\n") and [p.name for p in path.parent.iterdir()] == ["result.json"]  # no temporary left
