"""The machine's pace (issue 52): a fixed reference workload timed beside every iteration; ``compare`` says how far it
moved and, with ``pace="adjusted"`` (``--pace adjusted``), judges a config's times adjusted for it, so a machine
slower for a whole run is not read as the code's regression; ``pace="both"`` flags only what both judgements flag."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from opsd_rollout.bench.compare import compare_documents, flaggable_pct
from opsd_rollout.bench.pace import REFERENCE_METRIC, adjusted_ratio, paced, paced_medians, t_quantile
from opsd_rollout.bench.reference import ReferenceWorkload, without_reference
from opsd_rollout.bench.report import ConfigResult
from opsd_rollout.bench.scenarios import RolloutConfig
from opsd_rollout.cli import main
from tests.test_compare import document


def run(rng: np.random.Generator, *, machine: float = 1.0, code: float = 1.0, processes: int = 6,
        iterations: int = 2, between: float = 0.03) -> dict:
    """A result file of one config: ``processes`` processes, each at a level lognormal around 1 (sigma ``between``,
    what a fresh process's layout does to both its times and its reference), its times 100 ms x ``code`` x
    ``machine`` and its reference 10 ms x ``machine`` (the machine's pace moves both; the code, the times alone)."""
    levels = rng.lognormal(0, between, processes)
    doc = document({"1": [list(100 * code * machine * level * rng.lognormal(0, 0.01, iterations))
                          for level in levels]})
    result = doc["results"][0]
    for level, process in zip(levels, result["processes"]):
        for iteration in process["iterations"]:
            iteration[REFERENCE_METRIC] = 10 * machine * level * rng.lognormal(0, 0.01)
            iteration["tokens_per_second"] = 1000 / iteration["total_ms"]
    result["iterations"] = [it for p in result["processes"] for it in p["iterations"]]
    return doc


def test_a_machine_slower_for_a_whole_run_is_not_a_regression_when_judged_against_its_pace():
    """Pair 6 of issue 52 planted: every process of the second run 15% slower, the reference too, the code the
    same. Judged as measured it is a regression, and a note says the reference moved; adjusted for the machine's pace
    it is not, nor judged both ways (the default)."""
    rng = np.random.default_rng(6)
    before, after = run(rng), run(rng, machine=1.15)
    assert compare_documents(before, after).regressions == []
    raw = compare_documents(before, after, pace="measured")
    assert [c.metric for c in raw.regressions] == ["total_ms", "tokens_per_second"]
    assert not any(c.paced for c in raw.changes)
    assert any("1.1" in note and "judged as measured" in note for note in raw.notes)
    comparison = compare_documents(before, after, pace="adjusted")
    assert comparison.regressions == []
    assert all(c.paced == (paced(c.metric) is not None) and c.by_processes for c in comparison.changes)
    total = next(c for c in comparison.changes if c.metric == "total_ms")
    assert total.ratio == pytest.approx(1.0, abs=0.03)
    assert total.after / total.before == pytest.approx(1.15, abs=0.05)  # the medians shown are as measured
    assert comparison.machine[before["results"][0]["key"]] == pytest.approx(1.15, abs=0.05)
    assert any("1.1" in note and "adjusted for it" in note for note in comparison.notes)


@pytest.mark.parametrize("machine", [1.0, 0.9, 1.1])
def test_a_slower_code_is_flagged_however_the_machine_moved(machine):
    """The code 15% slower, the reference untouched by it: flagged in at least 19 of 20 planted pairs whether the
    machine stayed, sped up or slowed down, and the ratio is the code's; the same code is never flagged."""
    rng = np.random.default_rng(int(machine * 10))
    flagged = same = 0
    for _ in range(20):
        before = run(rng)
        comparison = compare_documents(before, run(rng, machine=machine, code=1.15), pace="adjusted")
        flagged += [c.metric for c in comparison.regressions] == ["total_ms", "tokens_per_second"]
        total = next(c for c in comparison.changes if c.metric == "total_ms")
        assert total.ratio == pytest.approx(1.15, abs=0.06)
        same += bool(compare_documents(before, run(rng, machine=machine), pace="adjusted").regressions)
    assert flagged >= 19 and same == 0


def test_judged_both_ways_a_regression_is_one_only_where_both_judgements_find_it():
    """``pace="both"``: a machine slower for a whole run (a regression as measured, none adjusted) and a slower code on
    a machine that sped up as much (none as measured, one adjusted) are neither; the ratio and interval shown are the
    times as measured, the adjusted ones beside them."""
    rng = np.random.default_rng(6)
    before = run(rng)
    machine_only, hidden = run(rng, machine=1.15), run(rng, machine=1 / 1.15, code=1.15)
    assert compare_documents(before, machine_only, pace="measured").regressions
    assert not compare_documents(before, machine_only, pace="adjusted").regressions
    assert not compare_documents(before, hidden, pace="measured").regressions
    assert compare_documents(before, hidden, pace="adjusted").regressions
    for after, measured, adjusted in ((machine_only, 1.15, 1.0), (hidden, 1.0, 1.15)):
        comparison = compare_documents(before, after, pace="both")
        assert comparison.regressions == []
        total = next(c for c in comparison.changes if c.metric == "total_ms")
        assert total.adjusted is not None and not total.paced and total.verdict == "not significant"
        assert total.ratio == pytest.approx(measured, abs=0.05)
        assert total.adjusted[0] == pytest.approx(adjusted, abs=0.05)
        assert total.adjusted[1] < total.adjusted[0] < total.adjusted[2]
        assert any("--pace both" in note for note in comparison.notes)
        alone = [next(c for c in compare_documents(before, after, pace=pace).changes if c.metric == "total_ms")
                 for pace in ("measured", "adjusted")]  # the smallest slowdown flagged both ways: the larger's
        assert flaggable_pct(total, 5.0) == pytest.approx(max(flaggable_pct(c, 5.0) for c in alone))


def test_judged_both_ways_a_slower_code_on_a_steady_machine_is_flagged_and_the_same_code_never():
    """The planted 15% on a machine that stayed: both judgements find it, so ``pace="both"`` flags it in at least 19
    of 20 pairs; the same code never. (Where the machine moved as much as the code, the times as measured hide it and
    ``both`` does too: the test above.)"""
    rng = np.random.default_rng(15)
    flagged = same = 0
    for _ in range(20):
        before = run(rng)
        comparison = compare_documents(before, run(rng, code=1.15), pace="both")
        flagged += [c.metric for c in comparison.regressions] == ["total_ms", "tokens_per_second"]
        same += bool(compare_documents(before, run(rng), pace="both").regressions)
    assert flagged >= 19 and same == 0


def test_judged_both_ways_without_the_reference_is_judged_as_measured():
    """Files without ``reference_ms``: ``both`` has one judgement to go by, the times as measured; an unknown ``pace``
    is refused by name."""
    rng = np.random.default_rng(2)
    before, after = run(rng), run(rng, code=1.3)
    for document in (before, after):
        for process in document["results"][0]["processes"]:
            for iteration in process["iterations"]:
                del iteration[REFERENCE_METRIC]
    comparison = compare_documents(before, after, pace="both")
    assert [c.metric for c in comparison.regressions] == ["total_ms", "tokens_per_second"]
    assert all(c.adjusted is None and not c.paced for c in comparison.changes)
    with pytest.raises(ValueError, match="pace: expected one of measured, adjusted, both; got 'paced'"):
        compare_documents(before, after, pace="paced")


def test_files_without_the_reference_are_judged_as_measured():
    """An older file (no ``reference_ms``) on either side: the times are judged as measured, and no note speaks
    of the machine's pace."""
    rng = np.random.default_rng(1)
    before, after = run(rng), run(rng)
    for process in before["results"][0]["processes"]:
        for iteration in process["iterations"]:
            del iteration[REFERENCE_METRIC]
    comparison = compare_documents(before, after, pace="adjusted")
    assert comparison.changes and not any(c.paced for c in comparison.changes)
    assert comparison.machine == {} and not any("reference workload" in note for note in comparison.notes)


def test_each_process_s_figure_is_read_beside_its_reference():
    """A process's median and its median reference; a time and a rate are paced, a memory figure and the reference
    itself are not, and a process that lacks the reference leaves the config unpaced."""
    result = ConfigResult.from_dict(document({"1": [[10.0, 30.0], [40.0]]})["results"][0], RolloutConfig)
    assert paced_medians(result, "total_ms") is None  # no reference
    for process, pace in zip(result.processes or [], ([2.0, 6.0], [5.0])):
        for iteration, reference in zip(process["iterations"], pace):
            iteration[REFERENCE_METRIC] = reference
            iteration["tokens_per_second"] = 100.0
    assert paced_medians(result, "total_ms") == [(20.0, 4.0), (40.0, 5.0)]
    assert paced_medians(result, "tokens_per_second") == [(100.0, 4.0), (100.0, 5.0)]
    assert paced("peak_memory_bytes") is None and paced(REFERENCE_METRIC) is None
    assert paced_medians(result, "peak_memory_bytes") is None


def test_the_adjustment_is_the_analysis_of_covariance_of_log_figure_on_log_reference():
    """Checked against the formula: the ratio is ``exp(d)`` of the least-squares fit ``log y = a + d after + theta log
    x``, its interval the t-interval of ``d`` on n - 3 degrees of freedom (scipy's quantile); a reference that follows
    the figure exactly is divided out (theta 1), one that does not vary leaves the two files' log medians."""
    from scipy import stats

    rng = np.random.default_rng(9)
    x = rng.lognormal(0, 0.2, 12)
    y = 50 * x ** 0.6 * rng.lognormal(0, 0.02, 12) * np.r_[np.ones(6), 1.1 * np.ones(6)]
    ratio, low, high, theta = adjusted_ratio(list(zip(y[:6], x[:6])), list(zip(y[6:], x[6:])), 0.95)
    design = np.c_[np.ones(12), np.r_[np.zeros(6), np.ones(6)], np.log(x)]
    fit, residual, *_ = np.linalg.lstsq(design, np.log(y), rcond=None)
    error = np.sqrt(residual[0] / 9 * np.linalg.inv(design.T @ design)[1, 1])
    assert theta == pytest.approx(fit[2]) and ratio == pytest.approx(np.exp(fit[1]))
    assert (low, high) == (pytest.approx(np.exp(fit[1] - stats.t.ppf(0.975, 9) * error)),
                           pytest.approx(np.exp(fit[1] + stats.t.ppf(0.975, 9) * error)))
    assert 1.05 < low < ratio < high < 1.16 and 0.5 < theta < 0.7
    exact = adjusted_ratio([(10 * v, v) for v in (1.0, 2.0, 4.0)], [(30 * v, v) for v in (1.0, 3.0, 5.0)], 0.95)
    assert exact[0] == pytest.approx(3.0) and exact[3] == pytest.approx(1.0)
    flat = adjusted_ratio([(5.0, 2.0), (6.0, 2.0)], [(7.0, 2.0), (8.0, 2.0)], 0.95)
    assert flat[3] == 0.0 and flat[0] == pytest.approx(np.sqrt(56 / 30))


@pytest.mark.parametrize("dof", [1, 3, 9, 40])
def test_the_t_quantile_is_scipy_s(dof):
    from scipy import stats

    assert t_quantile(0.975, dof) == pytest.approx(stats.t.ppf(0.975, dof), abs=1e-6)


def test_pace_adjusted_judges_the_times_adjusted_for_the_reference(tmp_path, capsys):
    """``compare``: the machine's slower run is a regression as measured (``--pace measured``, exit 1), and the note
    names the flag; ``--pace adjusted`` takes the machine's pace out (exit 0), and so does ``--pace both``, the
    default."""
    rng = np.random.default_rng(6)
    paths = []
    for name, doc in (("a.json", run(rng)), ("b.json", run(rng, machine=1.15))):
        paths.append(str(tmp_path / name))
        (tmp_path / name).write_text(json.dumps(doc))
    markdown = tmp_path / "cmp.md"
    assert main(["compare", *paths, "--pace", "measured", "--markdown", str(markdown)]) == 1
    out = capsys.readouterr().out
    assert "reference workload" in out and "--pace adjusted" in out
    assert "| processes (6/6) |" in markdown.read_text() and "paced (6/6)" not in markdown.read_text()
    assert main(["compare", *paths, "--pace", "adjusted", "--markdown", str(markdown)]) == 0
    assert "| processes, paced (6/6) |" in markdown.read_text()
    assert main(["compare", *paths, "--markdown", str(markdown)]) == 0
    assert "| processes, both ways (6/6) |" in markdown.read_text() and " (adj " in markdown.read_text()
    assert "--pace both" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["compare", *paths, "--pace", "nope"])
    assert "--pace: invalid choice: 'nope'" in capsys.readouterr().err


def test_the_reference_workload_is_fixed_and_leaves_the_run_s_random_state_alone():
    """Two workloads built apart compute the same thing (a reference that changed would read as the machine
    moving); building and running one draws nothing from torch's default generator; a time is a positive number."""
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    first, second = ReferenceWorkload(), ReferenceWorkload()
    assert torch.equal(first.call(), second.call())
    assert first.run(calls=3) > 0
    assert torch.equal(torch.rand(4), expected)


def test_an_iteration_s_profile_fields_leave_the_reference_out():
    row = {"total_ms": 3.0, REFERENCE_METRIC: 1.0, "prefill_ms": 1.0}
    assert without_reference(row) == {"total_ms": 3.0, "prefill_ms": 1.0}


def test_the_runner_times_the_reference_beside_every_iteration(tmp_path, capsys, monkeypatch):
    """A real run (in this process): every iteration carries the reference's time, the file is a valid result
    document with it, and the tables, which read an iteration as a profile, still print; a finished run resumed
    measures nothing and so makes no reference workload (its weights and warm-up calls)."""
    import jsonschema

    from opsd_rollout.bench.report import load_schema

    output = tmp_path / "run.json"
    assert main(["bench", "--model", "llama-tiny", "--zero-stages", "none", "--batch-sizes", "1,2",
                 "--samples-per-prompt", "1", "--prompt-lengths", "8", "--response-lengths", "4", "--iterations", "2",
                 "--warmup", "0", "--output", str(output)]) == 0
    document = json.loads(output.read_text())
    jsonschema.validate(document, load_schema())
    for result in document["results"]:
        assert result["status"] == "ok" and len(result["iterations"]) == 2
        assert all(it[REFERENCE_METRIC] > 0 for it in result["iterations"])
        assert result["summary"][REFERENCE_METRIC]["count"] == 2
    assert "B2" in capsys.readouterr().out

    def unmade(*args, **kwargs):
        raise AssertionError("a run with nothing pending made the reference workload")

    monkeypatch.setattr("opsd_rollout.bench.runner.ReferenceWorkload", unmade)
    assert main(["bench", "--resume-results", str(output)]) == 0
    assert json.loads(output.read_text())["results"] == document["results"]
