"""The rollout-lead reproducer (issue 51, part 2: ``benchmarks/rollout-lead/measure.py``) in its ``--quick`` mode: both
workload files of ``benchmarks/perf/`` at tiny shapes, at 195f6ff (a temporary worktree) and on this checkout, ours
against DeepSpeed's rollout; every ratio it reports is there with an interval, and the work was the same."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import clean_env, run_named

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "rollout-lead" / "measure.py"


@pytest.mark.slow
def test_the_quick_mode_measures_both_commits_on_the_same_work(tmp_path):
    done = run_named("the rollout-lead reproducer", [sys.executable, str(SCRIPT), "--quick", "--output-dir",
                                                     str(tmp_path)], timeout=3600, env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quick"] and summary["rounds"] == 1
    shared, tail = summary["workloads"]["shared-prefix"], summary["workloads"]["long-tail"]
    for commit in ("195f6ff", "today"):
        assert set(shared["commits"][commit]["lead"]) == {"static P16", "static P32"}
        assert set(shared["commits"][commit]["decode_per_token"]) == {"static P32 over P16",
                                                                      "deepspeed P32 over P16"}
        assert set(tail["commits"][commit]["lead"]) == {"static P16", "static P16 cbs=2"}
        for figure in [*shared["commits"][commit]["lead"].values(), *tail["commits"][commit]["lead"].values()]:
            assert 0 < figure["low"] <= figure["ratio"] <= figure["high"]
    assert set(tail["today_over_old"]) == {"static P16", "static P16 cbs=2", "deepspeed P16"}
    for workload in (shared, tail):  # every contender and commit decoded the same tokens
        assert all(len(tokens) == 1 for tokens in workload["same_work"].values()), workload["same_work"]
