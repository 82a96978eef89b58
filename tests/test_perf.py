"""``make perf`` (``scripts/perf.py``) gives one verdict a run (issue 52, part 4): a regression beyond the spread
between processes, no regression with the smallest slowdown it could have flagged, or no verdict when configs were
disturbed or a suite could not run; judged on planted baselines and results (no benchmark runs here)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import perf
from test_compare import BUSY, document, processes


def suite(rng: np.random.Generator, *, scale: float = 1.0, count: int = 6, disturbed: bool = False) -> dict:
    """A planted smoke result: two configs, ``count`` processes 3% apart of 3 iterations, times ``scale``."""
    planted = document({b: processes(rng, count, between=0.03, scale=scale) for b in ("1", "4")})
    if disturbed:
        planted["results"][0]["interference"] = dict(BUSY)
    return planted


@pytest.fixture
def baseline(tmp_path, monkeypatch):
    """``benchmarks/perf/bench.json`` planted in a directory of its own; returns where results go."""
    monkeypatch.setattr(perf, "BASELINES", tmp_path / "baselines")
    perf.BASELINES.mkdir()
    (perf.BASELINES / "bench.json").write_text(json.dumps(suite(np.random.default_rng(0))))
    out = tmp_path / "out"
    out.mkdir()
    return out


def judge(out, result: dict) -> tuple[int, object]:
    (out / "bench.json").write_text(json.dumps(result))
    return perf.judge("bench", out, 5.0)


def test_a_planted_1_15x_slowdown_is_one_regression_verdict(baseline, capsys):
    status, comparison = judge(baseline, suite(np.random.default_rng(1), scale=1.15))
    out = capsys.readouterr().out
    assert status == 1 and comparison.regressions and "perf: bench: REGRESSED" in out
    assert "B1 n1 P8 R4: total_ms" in out and (baseline / "bench.md").is_file()
    code, line = perf.verdict({"kernels": 0, "bench": status}, 300.0, 0.2)
    assert code == 1 and line == ("perf: REGRESSION (bench): beyond the threshold over the spread between processes "
                                  "(5.0 min, load 0.2 at the start)")


def test_the_same_code_is_no_regression_and_says_what_it_could_have_flagged(baseline, capsys):
    status, comparison = judge(baseline, suite(np.random.default_rng(2)))
    out = capsys.readouterr().out
    assert status == 0 and all(c.by_processes for c in comparison.changes)
    could = float(out.split("could flag a slowdown of ")[1].split("%")[0])
    assert 5 < could < 15  # the threshold plus the half-width 6 processes 3% apart leave
    assert perf.verdict({"kernels": 0, "bench": 0}, 60.0, None) == (0, "perf: no regression (1.0 min)")


def test_disturbed_configs_or_a_failed_suite_give_no_verdict(baseline, capsys):
    status, _ = judge(baseline, suite(np.random.default_rng(3), disturbed=True))
    assert status == 5 and "disturbed while they ran, not judged" in capsys.readouterr().out
    code, line = perf.verdict({"kernels": 0, "bench": status}, 60.0, 3.2)
    assert code == 3 and line.startswith("perf: NO VERDICT: configs were disturbed")
    assert perf.verdict({"kernels": 2, "bench": 0}, 60.0, 0.1)[0] == 2
    assert perf.verdict({"kernels": 2, "bench": 1}, 60.0, 0.1)[0] == 1  # a regression is news whatever else failed


def test_a_one_process_baseline_is_judged_widened_and_says_so(baseline, capsys):
    (perf.BASELINES / "bench.json").write_text(json.dumps(document({"1": processes(np.random.default_rng(4), 1,
                                                                                          between=0, iterations=6)[0]})))
    judge(baseline, document({"1": processes(np.random.default_rng(5), 6, between=0.03)}))
    out = capsys.readouterr().out
    assert "note: every config: BEFORE 1 process and AFTER 6 processes a config" in out and "widened by 20%" in out


def test_every_suite_is_a_matrix_perf_can_measure_with_its_processes_and_warm_up():
    """Each suite's command and arguments parse into the matrix its workers measure, with perf's processes,
    iterations and one warm-up call (the workload files checked as a run checks them)."""
    from opsd_rollout.cli.bench import matrix_of

    for name in perf.SUITES:
        matrix, settings = matrix_of(*perf.suite_command(name))
        assert (settings.processes, settings.iterations, settings.warmup) == (perf.PROCESSES, perf.ITERATIONS,
                                                                               perf.WARMUP)
        assert matrix.expand(), name
    assert {"kernels", "bench", "long-tail", "shared-prefix"} <= set(perf.SUITES)


@pytest.mark.parametrize("argv, named", [(["--batch-sizes", "0"], "batch"), (["--no-such-flag"], "--no-such-flag")])
def test_a_suite_with_a_bad_argument_is_refused_naming_it(argv, named):
    from opsd_rollout.cli.bench import COMMANDS, matrix_of

    with pytest.raises(ValueError, match=named):
        matrix_of(COMMANDS[0], argv)


def test_how_far_the_machine_moved_is_printed_beside_the_verdict(baseline, capsys):
    """Both files timed the reference workload in every process, the second run's 20% slower: perf prints the
    compare note saying how far it moved (a flag then is worth a rerun)."""
    rng = np.random.default_rng(5)
    paced = [suite(rng), suite(rng)]
    for run, pace in zip(paced, (10.0, 12.0)):
        for result in run["results"]:
            for iteration in (it for p in result["processes"] for it in p["iterations"]):
                iteration["reference_ms"] = pace * rng.lognormal(0, 0.01)
            result["iterations"] = [it for p in result["processes"] for it in p["iterations"]]
    (perf.BASELINES / "bench.json").write_text(json.dumps(paced[0]))
    judge(baseline, paced[1])
    assert "note: the machine's pace: the reference workload" in capsys.readouterr().out
    assert "took 1.20 times as long in AFTER" in (baseline / "bench.md").read_text()


def test_update_refuses_a_disturbed_result_and_keeps_the_baselines(baseline, capsys, monkeypatch):
    """A baseline config disturbed while it ran is never judged, so every later perf run would give no verdict on it:
    --update refuses the whole update (exit 3), names the config, and leaves the baselines as they were."""
    kept = (perf.BASELINES / "bench.json").read_text()
    (baseline / "bench.json").write_text(json.dumps(suite(np.random.default_rng(1), disturbed=True)))
    assert perf.update(baseline, ["bench"]) == 3
    assert "NOT recorded" in capsys.readouterr().err and (perf.BASELINES / "bench.json").read_text() == kept
    monkeypatch.setattr(perf, "ROOT", perf.BASELINES.parent)  # where the recorded baselines are named from
    (baseline / "bench.json").write_text(json.dumps(suite(np.random.default_rng(1))))
    assert perf.update(baseline, ["bench"]) == 0 and (perf.BASELINES / "bench.json").read_text() != kept


def test_against_a_revision_judges_against_its_results_from_the_same_run(baseline, capsys):
    """``--against REV``: each suite judged against REV's results of the same run (beside REV's tree), not the
    committed baselines; the verdict names REV; a side that measured nothing gives no verdict."""
    against = baseline / "against"
    against.mkdir()
    (against / "bench.json").write_text(json.dumps(suite(np.random.default_rng(7))))
    (baseline / "bench.json").write_text(json.dumps(suite(np.random.default_rng(8), scale=1.15)))
    status, comparison = perf.judge("bench", baseline, 5.0, against)
    assert status == 1 and comparison.regressions
    assert perf.judge("long-tail", baseline, 5.0, against)[0] == 2
    assert "perf: long-tail: " in capsys.readouterr().out
    code, line = perf.verdict({"bench": 0}, 600.0, 0.3, "main (1234567890)")
    assert (code, line) == (0, "perf: no regression (against main (1234567890), 10.0 min, load 0.3 at the start)")


def test_against_checks_out_the_revision_and_maps_this_checkouts_paths_into_it(tmp_path):
    tree, commit = perf.checkout("HEAD", tmp_path / "tree")
    assert (tree / "src" / "opsd_rollout" / "bench" / "processes.py").is_file()
    assert (tree / "COMMIT").read_text().strip() == commit and len(commit) == 40
    assert perf.tree_path(str(perf.ROOT / "src"), tree) == str(tree / "src")
    assert perf.tree_path(str(perf.ROOT / "scripts"), tree) == str(tree / "scripts")
    with pytest.raises(ValueError, match="from this checkout's src/"):
        perf.tree_path("/usr/lib/python3/site-packages", tree)
    with pytest.raises(ValueError, match="'no-such-rev' is no commit"):
        perf.checkout("no-such-rev", tmp_path / "other")


def test_more_processes_and_the_pace_adjustment_reach_every_run_and_judgement(repository, monkeypatch, tmp_path,
                                                                              capsys):
    """``--processes 12 --pace both``: both runs measure 12 processes a side and both judgements judge both ways (12 a
    side is about what issue 52's goal takes, RESULTS); fewer than compare's fewest is refused."""
    rng = np.random.default_rng(14)
    calls = planted_runs(monkeypatch, suite(rng, scale=1.2), (suite(rng), suite(rng)))
    judged, real_judge = [], perf.judge

    def judge(name, out, threshold, baselines=None, label=None, pace="measured"):
        judged.append(pace)
        return real_judge(name, out, threshold, baselines, label, pace)

    monkeypatch.setattr(perf, "judge", judge)
    assert perf.main(["--suites", "bench", "--output-dir", str(tmp_path / "out"), "--processes", "12",
                      "--pace", "both"]) == 0
    assert [c[3] for c in calls] == [12, 12] and judged == ["both", "both"]
    assert perf.suite_command("bench", 12)[1][-6:-4] == ["--processes", "12"]
    with pytest.raises(SystemExit):
        perf.main(["--processes", "2", "--output-dir", str(tmp_path)])
    assert "--processes: at least 4" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["--against", "no-such-rev"], "is no commit"),
                                        (["--against", "HEAD", "--update"], "--against and --update")])
def test_against_refuses_bad_arguments_before_any_work(argv, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        perf.main([*argv, "--output-dir", str(tmp_path)])
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_a_flag_settled_beside_the_baselines_revision_is_confirmed_cleared_or_stands():
    """The verdict after a settling run: a flag the same-run comparison cleared is no regression (and says so), one
    it confirmed is a regression naming the revision, one it could not settle stays a regression and says why."""
    cleared = perf.verdict({"kernels": 0, "bench": 1}, 600.0, 0.3, settled={"bench": (0, "1234567890")})
    assert cleared == (0, "perf: no regression (bench's flag against the baselines was not confirmed beside "
                          "1234567890 in the same run; 10.0 min, load 0.3 at the start)")
    code, line = perf.verdict({"bench": 1, "long-tail": 1}, 60.0, None,
                              settled={"bench": (1, "1234567890"), "long-tail": (0, "1234567890")})
    assert code == 1 and line.startswith("perf: REGRESSION (bench, confirmed beside 1234567890 in the same run): ")
    assert "long-tail's flag against the baselines was not confirmed" in line
    code, line = perf.verdict({"bench": 1}, 60.0, None, settled={"bench": (2, "bench.json is in no commit")})
    assert code == 1 and "(bench, against the baselines; not settled: bench.json is in no commit)" in line


@pytest.fixture
def repository(tmp_path, monkeypatch):
    """A git repository as perf's ROOT, its baseline ``benchmarks/perf/bench.json`` committed."""
    root = tmp_path / "repo"
    monkeypatch.setattr(perf, "ROOT", root)
    monkeypatch.setattr(perf, "BASELINES", root / "benchmarks" / "perf")
    perf.BASELINES.mkdir(parents=True)
    (perf.BASELINES / "bench.json").write_text(json.dumps(suite(np.random.default_rng(0))))
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "baselines"]):
        subprocess.run([*git, *command], check=True)
    return root


def planted_runs(monkeypatch, first: dict, beside: tuple[dict, dict]) -> list:
    """``perf.run`` replaced: the first call (against the baselines) writes ``first``, a settling call (with a
    revision's tree) writes ``beside``: this checkout's result and the revision's. Returns the calls (ROOT is not the
    checkout the package is imported from, so the tree's path for it is planted too)."""
    calls = []

    def run(names, out, against=None, processes=None):
        calls.append((names, out, against, processes))
        if against is None:
            (out / "bench.json").write_text(json.dumps(first))
        else:
            (out / "bench.json").write_text(json.dumps(beside[0]))
            (against.parent / "bench.json").write_text(json.dumps(beside[1]))
        return {name: True for name in names}

    monkeypatch.setattr(perf, "run", run)
    monkeypatch.setattr(perf, "tree_path", lambda path, tree: str(tree / "src"))  # the package is not ROOT's
    return calls


def test_a_flag_the_same_run_clears_is_no_regression(repository, monkeypatch, tmp_path, capsys):
    """``make perf`` flags a drifted run against the baselines, measures the flagged suite again beside the commit
    that recorded its baseline, and gives one verdict: no regression, the settling run's files kept apart."""
    rng = np.random.default_rng(11)
    calls = planted_runs(monkeypatch, suite(rng, scale=1.2), (suite(rng), suite(rng)))
    out = tmp_path / "out"
    assert perf.main(["--suites", "bench", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    commit = perf.baseline_revision("bench")[0]
    assert len(calls) == 2 and calls[1][0] == ["bench"] and calls[1][1] == out / "settle" / commit[:10]
    assert (calls[1][2] / "COMMIT").read_text().strip() == commit  # the baselines' revision, checked out
    assert "perf: bench: REGRESSED" in printed
    assert f"perf: settling bench: measured again beside {commit[:10]}" in printed
    assert printed.splitlines()[-1].startswith("perf: no regression (bench's flag against the baselines was not "
                                               f"confirmed beside {commit[:10]} in the same run; ")
    record = json.loads((out / "verdict.json").read_text())
    assert record["status"] == 0 and record["suites"] == {"bench": 1}
    assert record["settled"] == {"bench": {"status": 0, "revision_or_why": commit[:10]}}


def test_a_flag_the_same_run_confirms_is_a_regression_and_no_settle_leaves_it(repository, monkeypatch,
                                                                              tmp_path, capsys):
    rng = np.random.default_rng(12)
    calls = planted_runs(monkeypatch, suite(rng, scale=1.2), (suite(rng, scale=1.2), suite(rng)))
    assert perf.main(["--suites", "bench", "--output-dir", str(tmp_path / "out")]) == 1
    assert "(bench, confirmed beside " in capsys.readouterr().out.splitlines()[-1] and len(calls) == 2
    assert calls[0][3] is None and calls[1][3] is None  # perf's PROCESSES
    calls.clear()
    assert perf.main(["--suites", "bench", "--output-dir", str(tmp_path / "out"), "--no-settle"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("perf: REGRESSION (bench): ") and len(calls) == 1


def test_a_baseline_no_commit_recorded_is_not_settled_and_the_flag_stands(repository, monkeypatch,
                                                                          tmp_path, capsys):
    (perf.BASELINES / "bench.json").write_text(json.dumps(suite(np.random.default_rng(1))))  # --update, uncommitted
    assert perf.baseline_revision("bench") == (None, "benchmarks/perf/bench.json has changes not committed, so no "
                                                     "revision measured it")
    calls = planted_runs(monkeypatch, suite(np.random.default_rng(13), scale=1.2), ({}, {}))
    assert perf.main(["--suites", "bench", "--output-dir", str(tmp_path / "out")]) == 1
    assert "not settled: benchmarks/perf/bench.json has changes not committed" in capsys.readouterr().out
    assert len(calls) == 1


@pytest.fixture
def tiny_suite(monkeypatch):
    """perf's suites cut to one tiny bench config in 2 processes a side of 1 iteration: the whole path in a minute."""
    monkeypatch.setattr(perf, "SUITES", {"bench": ("bench", ["--model", "llama-tiny", "--batch-sizes", "1",
                                                             "--samples-per-prompt", "1", "--prompt-lengths", "8",
                                                             "--response-lengths", "4", "--zero-stages", "none"])})
    monkeypatch.setattr(perf, "PROCESSES", 2)
    monkeypatch.setattr(perf, "ITERATIONS", 1)


@pytest.mark.slow
def test_against_head_measures_both_sides_in_one_run(tmp_path, tiny_suite, capsys):
    """The whole path on a tiny suite: HEAD's tree checked out, 2 workers a side taking turns, each side's document
    whole, one verdict naming the revision (which verdict, on 2 processes a side, is the machine's to say)."""
    status = perf.main(["--against", "HEAD", "--suites", "bench", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "suite(s) of this checkout and of" in out and "the sides taking turns" in out
    assert status in (0, 1, 3), out
    assert out.splitlines()[-1].startswith("perf: ") and "against HEAD (" in out.splitlines()[-1]
    for document in (tmp_path / "bench.json", tmp_path / "against" / "bench.json"):
        results = json.loads(document.read_text())["results"]
        assert results and all(len(r["processes"]) == 2 for r in results), document
    assert (tmp_path / "against" / "tree" / "COMMIT").is_file()


@pytest.mark.slow
def test_a_real_settling_run_measures_the_baselines_revision_beside_this_checkout(tmp_path, tiny_suite, capsys):
    """``settle`` on a tiny suite: the commit that recorded the smoke bench's committed baseline checked out, 2
    workers a side taking turns, and a judgement of the same run naming that commit (which judgement, on 2 processes a
    side, and whether other processes disturbed it, are the machine's to say; a failed run fails here)."""
    commit, why = perf.baseline_revision("bench")
    assert commit, why
    settled = perf.settle(["bench"], tmp_path, 5.0)
    short = commit[:10]
    assert settled["bench"] in {(0, short), (1, short), (2, f"the settling run beside {short} was disturbed")}
    where = tmp_path / "settle" / short
    assert (where / "against" / "tree" / "COMMIT").read_text().strip() == commit
    for document in (where / "bench.json", where / "against" / "bench.json"):
        assert all(len(r["processes"]) == 2 for r in json.loads(document.read_text())["results"]), document
    assert f"perf: bench beside {short}: " in capsys.readouterr().out
