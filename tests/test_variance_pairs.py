"""The rerunnable measurement of issue 52, part 3 (``benchmarks/variance/same_code_pairs.py``): pairs of same-code
runs judged by ``compare``, and a planted slowdown of each pair's second run. On planted runs (no benchmark here):
the slowdown scales every time and throughput once and nothing else, same-code pairs pass and planted ones are
flagged, a run already made is kept, bad options are refused; one slow test runs its quick mode end to end, every
run in fresh worker processes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import clean_env, run_named
from test_compare import document, processes

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "variance" / "same_code_pairs.py"
_spec = importlib.util.spec_from_file_location("same_code_pairs", SCRIPT)
pairs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pairs)


def test_the_planted_slowdown_scales_every_time_and_throughput_once_and_nothing_else():
    run = document({"1": [[10.0, 12.0], [11.0, 13.0]]})
    shared = {"total_ms": 10.0, "tokens_per_second": 200.0, "peak_memory_bytes": 2**30, "generated_tokens": 4,
              "rollout_share": 0.5, "reference_ms": 3.0}
    run["results"][0]["iterations"][0] = run["results"][0]["processes"][0]["iterations"][0] = shared  # one dict
    slowed = pairs.scaled(run, 1.15)
    for iterations in (slowed["results"][0]["iterations"], slowed["results"][0]["processes"][0]["iterations"]):
        assert iterations[0] == {"total_ms": pytest.approx(11.5), "tokens_per_second": pytest.approx(200 / 1.15),
                                 "peak_memory_bytes": 2**30, "generated_tokens": 4, "rollout_share": 0.5,
                                 "reference_ms": 3.0}  # the machine's pace: the code's slowdown leaves it
    assert [it["total_ms"] for it in slowed["results"][0]["processes"][1]["iterations"]] == \
        [pytest.approx(11 * 1.15), pytest.approx(13 * 1.15)]
    assert shared["total_ms"] == 10.0 and run["results"][0]["iterations"][1]["total_ms"] == 12.0  # input untouched


def plant(runs_dir: Path, count: int, seed: int = 0) -> None:
    """``count`` pairs of complete smoke runs in ``runs_dir``: two configs, 6 processes 3% apart of 3 iterations,
    the same distribution on both sides (what ``make perf`` records of the same code on a quiet machine), the
    reference workload timed beside each iteration."""
    rng = np.random.default_rng(seed)
    for index in range(1, count + 1):
        for side in "ab":
            run = {**document({b: processes(rng, 6, between=0.03) for b in ("1", "4")}),
                   "settings": pairs.perf_settings()}
            for result in run["results"]:
                for iteration in (it for p in result["processes"] for it in p["iterations"]):
                    iteration["reference_ms"] = 10 * rng.lognormal(0, 0.01)
                result["iterations"] = [it for p in result["processes"] for it in p["iterations"]]
            (runs_dir / f"rollout-{index}-{side}.json").write_text(json.dumps(run))


def test_same_code_pairs_pass_and_their_planted_slowdown_is_flagged(tmp_path, monkeypatch, capsys):
    plant(tmp_path, 3)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a run was made where one was kept"))
    output = tmp_path / "out" / "pairs.json"
    assert pairs.main(["--pairs", "3", "--kinds", "rollout", "--runs-dir", str(tmp_path),
                       "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert list(result["kinds"]) == ["rollout"] and result["settings"]["processes"] == 6
    rollout = result["kinds"]["rollout"]
    assert rollout["same_code_pairs_with_a_regression"] == 0 and rollout["planted_pairs_flagged"] == 3
    assert rollout["same_code_pairs_with_a_regression_as_measured"] == 0
    assert rollout["planted_pairs_flagged_as_measured"] == 3
    assert rollout["same_code_pairs_with_a_regression_both"] == 0 and rollout["planted_pairs_flagged_both"] == 3
    assert rollout["pairs_with_a_disturbed_config"] == 0 and 1 < rollout["largest_ratio_of_two_processes"] < 1.2
    for pair in rollout["pairs"]:
        assert all(run["reused"] for run in pair["runs"])
        assert pair["same_code"]["exit_status"] == 0 and pair["planted"]["exit_status"] == 1
        assert pair["same_code"]["by_processes"] and pair["planted"]["by_processes"]
        assert pair["planted"]["paced"] and not pair["planted_as_measured"]["paced"]
        assert not pair["planted_both"]["paced"]  # both ways: the ratio shown is as measured
        flagged = {name: {(r["config"], r["metric"]) for r in pair[name]["regressions"]}
                   for name in ("planted", "planted_as_measured", "planted_both")}
        assert flagged["planted_both"] == flagged["planted"] & flagged["planted_as_measured"]  # both, and only both
        assert all(0.95 < ratio < 1.05 for ratio in pair["planted"]["machine"].values())  # the reference unscaled
        assert {r["metric"] for r in pair["planted"]["regressions"]} >= {"total_ms"}
        assert all(5 < pct < 20 for pct in pair["same_code"]["flaggable_pct"].values())  # widened: over 26%
    assert ("rollout: same-code pairs with a regression: 0 of 3 (0 as measured); planted 1.15x flagged: 3 of 3 "
            "(3 as measured)") in capsys.readouterr().out
    assert [p.name for p in output.parent.iterdir()] == ["pairs.json"]  # written atomically: no temporary left


def test_an_interleaved_pair_is_one_run_its_odd_and_even_processes_the_two_sides(tmp_path, monkeypatch):
    """``--interleaved``: one run of 12 processes a config, dealt to two runs of 6 as perf --against deals two
    revisions' (A B, B A, ...); a steady drift across the run (each process 0.5% slower than the last) lands on both
    sides alike: the same code is no regression, and a planted 15% slowdown is flagged."""
    assert pairs.alternating_sides(8) == ([0, 3, 4, 7], [1, 2, 5, 6])
    rng = np.random.default_rng(4)
    run = {**document({b: processes(rng, 12, between=0.01) for b in ("1", "4")}),
           "settings": {**pairs.perf_settings(), "processes": 12}}
    for result in run["results"]:
        for number, process in enumerate(result["processes"]):
            for iteration in process["iterations"]:
                iteration["total_ms"] *= 1.005 ** number
                iteration["reference_ms"] = 10 * 1.005 ** number
        result["iterations"] = [it for p in result["processes"] for it in p["iterations"]]
    (tmp_path / "rollout-1-ab.json").write_text(json.dumps(run))
    before, after = pairs.split_interleaved(run)
    for side, dealt in zip((before, after), pairs.alternating_sides(12)):
        assert side["settings"]["processes"] == 6
        for result, whole in zip(side["results"], run["results"]):
            assert result["processes"] == [whole["processes"][i] for i in dealt]
            assert result["iterations"] == [it for i in dealt for it in whole["processes"][i]["iterations"]]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a run was made where one was kept"))
    output = tmp_path / "pairs.json"
    assert pairs.main(["--pairs", "1", "--kinds", "rollout", "--interleaved", "--runs-dir", str(tmp_path),
                       "--output", str(output)]) == 0
    rollout = json.loads(output.read_text())["kinds"]["rollout"]
    assert rollout["same_code_pairs_with_a_regression_as_measured"] == 0
    assert rollout["planted_pairs_flagged_as_measured"] == 1


def test_a_kept_run_made_at_other_settings_is_made_again(tmp_path, monkeypatch):
    """The runs kept in ``--runs-dir`` are reused only at the settings asked for (make perf's by default): a run
    kept from before make perf changed its settings is run again, never judged as today's."""
    plant(tmp_path, 1)
    stale = json.loads((tmp_path / "rollout-1-b.json").read_text())
    stale["settings"] = {**pairs.perf_settings(), "iterations": 3}
    (tmp_path / "rollout-1-b.json").write_text(json.dumps(stale))
    assert not pairs.complete(tmp_path / "rollout-1-b.json", pairs.parse_args([]))
    unpaced = json.loads((tmp_path / "rollout-1-a.json").read_text())  # made before the reference was timed
    assert pairs.complete(tmp_path / "rollout-1-a.json", pairs.parse_args([]))
    for result in unpaced["results"]:
        for iteration in result["iterations"]:
            del iteration["reference_ms"]
    (tmp_path / "older.json").write_text(json.dumps(unpaced))
    assert not pairs.complete(tmp_path / "older.json", pairs.parse_args([]))
    made = []

    def record(command, **kwargs):
        made.append(command)
        raise InterruptedError("stopped after the first run made")

    monkeypatch.setattr(subprocess, "run", record)
    with pytest.raises(InterruptedError):
        pairs.main(["--pairs", "1", "--kinds", "rollout", "--runs-dir", str(tmp_path),
                    "--output", str(tmp_path / "pairs.json")])
    assert len(made) == 1 and made[0][-1] == str(tmp_path / "rollout-1-b.json")
    expected = pairs.perf_settings()
    for flag in ("processes", "iterations", "warmup"):
        assert made[0][made[0].index(f"--{flag}") + 1] == str(expected[flag])


@pytest.mark.parametrize("argv,message", [
    (["--pairs", "0"], "--pairs: expected at least 1; got 0"),
    (["--scale", "1"], "--scale: expected above 1; got 1"),
    (["--kinds", "rollout,kernels"], "--kinds: expected a comma list of rollout, step; got 'rollout,kernels'"),
    (["--quick", "--model", "llama-small"], "--quick runs the tiny models"),
])
def test_bad_options_are_refused_before_any_run(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        pairs.main([*argv, "--runs-dir", str(tmp_path)])
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # four runs of the tiny models, each in two fresh worker processes
def test_the_quick_mode_runs_both_kinds_end_to_end_and_keeps_its_runs(tmp_path):
    output, runs = tmp_path / "pairs.json", tmp_path / "runs"
    command = [sys.executable, str(SCRIPT), "--quick", "--allow-disturbed", "--runs-dir", str(runs),
               "--output", str(output)]
    done = run_named("the quick measurement", command, timeout=2400, env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["settings"]["pairs"] == 1 and result["settings"]["processes"] == 2
    for kind in ("rollout", "step"):
        (pair,) = result["kinds"][kind]["pairs"]
        assert all(run["seconds"] > 0 and "load_before" in run for run in pair["runs"])
        for side in "ab":
            made = json.loads((runs / f"{kind}-1-{side}.json").read_text())
            assert made["kind"] == kind and made["settings"]["processes"] == 2
            assert all(r["status"] == "ok" and len(r["processes"]) == 2 and len({p["pid"] for p in r["processes"]})
                       == 2 for r in made["results"])
        for judgement in (pair["same_code"], pair["planted"]):
            assert not judgement["by_processes"]  # 2 processes a side: judged over iterations, widened
            assert judgement["exit_status"] in (0, 1) and judgement["flaggable_pct"]
    again = run_named("the quick measurement, again", command, timeout=600, env=clean_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(run.get("reused") for kind in ("rollout", "step")  # no run made twice
               for run in json.loads(output.read_text())["kinds"][kind]["pairs"][0]["runs"])
