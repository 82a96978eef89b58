"""``compare``: the bootstrap interval of the ratio of medians, exit statuses that never pass a comparison of
nothing, and same-code runs that do not read as regressions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opsd_rollout.bench.compare import (EXIT_NOTHING_COMPARED, EXIT_PARTIAL, EXIT_REGRESSION, bootstrap_ratio,
                                        compare_documents)
from opsd_rollout.cli import main


def document(results: dict[str, list[float]], kind: str = "rollout") -> dict:
    """A minimal version-2 result file: one config per key (batch size), ``total_ms`` per iteration."""
    def config(batch: int) -> dict:
        return {"batch_size": batch, "samples_per_prompt": 1, "prompt_length": 8, "response_length": 4,
                "dtype": "fp32", "decoding": "greedy", "zero_stage": 0, "strategy": "static",
                "cache_policy": "retain", "forward_timing": True}

    rows = []
    for batch, times in results.items():
        c = config(int(batch))
        key = (f"B{c['batch_size']}-n1-P8-R4-fp32-greedy-zero0-static-retain-fwdon")
        rows.append({"key": key, "config": c, "status": "ok", "error": None, "derived": {}, "warnings": [],
                     "iterations": [{"total_ms": t, "peak_memory_bytes": 2**30} for t in times]})
    return {"schema_version": 2, "kind": kind, "environment": {}, "matrix": {}, "settings": {}, "run_order": [],
            "results": rows}


def test_the_interval_holds_the_ratio_and_excludes_one_only_for_a_real_change():
    same = [10.0, 10.4, 9.8, 10.1, 10.2, 9.9]
    ratio, low, high = bootstrap_ratio(same, same)
    assert ratio == 1.0 and low <= 1.0 <= high
    ratio, low, high = bootstrap_ratio(same, [t * 1.3 for t in same])
    assert ratio == pytest.approx(1.3) and low > 1.0 and low <= ratio <= high


def test_same_code_runs_do_not_read_as_regressions():
    """Twenty configs, both sides drawn from one noisy distribution (8% noise, slow drift, an outlier now
    and then, as on this shared machine): no regression beyond 5%."""
    rng = np.random.default_rng(1)

    def run() -> dict[str, list[float]]:
        return {str(b): list(100 * b * rng.lognormal(0, 0.08, 7) * np.linspace(1, 1.03, 7)
                             * np.where(rng.random(7) < 0.1, 1.6, 1.0)) for b in range(1, 21)}

    comparison = compare_documents(document(run()), document(run()))
    assert comparison.matched == 20 and not comparison.regressions
    assert comparison.exit_status() == 0


def test_a_real_slowdown_is_a_regression_and_a_small_one_is_not():
    rng = np.random.default_rng(2)
    base = {str(b): list(100 * b * rng.lognormal(0, 0.03, 9)) for b in (1, 2)}
    slower = {k: [t * 1.25 for t in v] for k, v in base.items()}
    assert len(compare_documents(document(base), document(slower)).regressions) == 2
    slightly = {k: [t * 1.02 for t in v] for k, v in base.items()}  # within the 5% threshold
    assert not compare_documents(document(base), document(slightly)).regressions


def test_exit_statuses_name_what_was_compared(tmp_path, capsys):
    def write(name: str, results: dict) -> str:
        path = tmp_path / name
        path.write_text(json.dumps(document(results)))
        return str(path)

    times = [10.0, 10.1, 9.9, 10.0, 10.2]
    a, b = write("a.json", {"1": times, "2": times}), write("b.json", {"1": times, "3": times})
    disjoint = write("c.json", {"4": times})
    assert main(["compare", a, disjoint]) == EXIT_NOTHING_COMPARED
    assert "nothing compared" in capsys.readouterr().out
    assert main(["compare", a, b]) == EXIT_PARTIAL
    out = capsys.readouterr().out
    assert "only in BEFORE" in out and "only in AFTER" in out
    assert main(["compare", a, b, "--allow-partial"]) == 0
    slow = write("slow.json", {"1": [t * 2 for t in times], "2": times})
    assert main(["compare", a, slow]) == EXIT_REGRESSION
    assert main(["compare", a, str(tmp_path / "missing.json")]) == 2
