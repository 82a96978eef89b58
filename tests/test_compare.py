"""``compare``: the Hodges-Lehmann ratio and its rank interval, exit statuses that never pass a comparison of
nothing, files of different work refused, disturbed configs not judged, a planted 1.5x slowdown caught and
same-code runs let through, in 80 columns.

Each case is planted into a real result document (one small run of the tiny model, made once for the module):
its iterations get planted timings and its configs a planted interference record, so what ``compare``
decides never depends on how busy this machine was while the run was made."""

from __future__ import annotations

import copy
import itertools
import json

import jsonschema
import numpy as np
import pytest

from opsd_rollout.bench.compare import (EXIT_BAD_INPUT, EXIT_DISTURBED, EXIT_NOTHING_COMPARED, EXIT_PARTIAL,
                                        EXIT_REGRESSION, compare_documents)
from opsd_rollout.bench.pace import REFERENCE_METRIC
from opsd_rollout.bench.ratio_test import EXACT_LIMIT, fewest_iterations, ratio_interval, tail_rank
from opsd_rollout.bench.report import SCHEMA_VERSION, ConfigResult, load_schema
from opsd_rollout.bench.same_work import MismatchError
from opsd_rollout.bench.scenarios import RolloutConfig
from opsd_rollout.cli import main


def document(results: dict[str, list], kind: str = "rollout") -> dict:
    """A minimal result file: one config per key (batch size), ``total_ms`` per iteration; a list of lists is one
    list per process (a version-5 config measured in several), a flat list one process."""
    def config(batch: int) -> dict:
        return {"batch_size": batch, "samples_per_prompt": 1, "prompt_length": 8, "response_length": 4,
                "dtype": "fp32", "decoding": "greedy", "zero_stage": 0, "strategy": "static",
                "cache_policy": "retain", "forward_timing": True}

    def iterations(times: list[float]) -> list[dict]:
        return [{"total_ms": t, "peak_memory_bytes": 2**30} for t in times]

    rows = []
    for batch, times in results.items():
        c = config(int(batch))
        key = (f"B{c['batch_size']}-n1-P8-R4-fp32-greedy-zero0-static-retain-fwdon")
        several = bool(times) and isinstance(times[0], list)
        processes = [{"pid": None, "iterations": iterations(p), "warmup": None, "interference": None, "derived": {},
                      "warnings": []} for p in times] if several else None
        rows.append({"key": key, "config": c, "status": "ok", "error": None, "derived": {}, "warnings": [],
                     "iterations": iterations([t for p in times for t in p] if several else times),
                     "processes": processes})
    return {"schema_version": SCHEMA_VERSION, "kind": kind, "environment": {}, "matrix": {}, "settings": {},
            "run_order": [], "results": rows}


def processes(rng: np.random.Generator, count: int, *, between: float, within: float = 0.01, iterations: int = 3,
              scale: float = 1.0) -> list[list[float]]:
    """``count`` processes of ``iterations`` times (ms): each process's level lognormal around 100 ms (sigma
    ``between``: what a fresh process's memory layout and clock state do), its iterations lognormal around that
    (sigma ``within``), all times ``scale``."""
    return [list(100 * scale * level * rng.lognormal(0, within, iterations))
            for level in rng.lognormal(0, between, count)]


# ---- the test itself -----------------------------------------------------------------------------------------

def test_the_interval_holds_the_ratio_and_excludes_one_only_for_a_real_change():
    same = [10.0, 10.4, 9.8, 10.1, 10.2, 9.9]
    ratio, low, high = ratio_interval(same, same, 0.95)
    assert ratio == 1.0 and low <= 1.0 <= high
    ratio, low, high = ratio_interval(same, [t * 1.3 for t in same], 0.95)
    assert ratio == pytest.approx(1.3) and low > 1.0 and low <= ratio <= high


@pytest.mark.parametrize("m,n", [(1, 1), (2, 3), (3, 3), (4, 4), (3, 5), (5, 5), (4, 6)])
def test_the_rank_cut_matches_the_mann_whitney_distribution_counted_by_hand(m, n):
    """Every ordering of m BEFORE and n AFTER values enumerated: the interval cuts the most ranks whose tail
    probability stays within 2.5%."""
    counts = np.zeros(m * n + 1)
    for before in itertools.combinations(range(m + n), m):
        counts[sum(1 for i in before for j in range(m + n) if j > i and j not in before)] += 1
    tail = np.cumsum(counts) / counts.sum()
    assert tail_rank(m, n, 0.95) == int(np.sum(tail <= 0.025))


def test_the_normal_approximation_takes_over_at_the_rank_the_exact_count_gives(monkeypatch):
    exact = [tail_rank(m, n, 0.95) for m, n in ((50, 50), (40, 60))]
    monkeypatch.setattr("opsd_rollout.bench.ratio_test.EXACT_LIMIT", 0)
    approximated = [tail_rank(m, n, 0.95) for m, n in ((50, 50), (40, 60))]
    assert all(abs(a - e) <= 1 for a, e in zip(approximated, exact)) and 40 * 60 <= EXACT_LIMIT


def test_too_few_iterations_leave_the_ratio_unbounded_and_say_how_many_are_needed():
    assert fewest_iterations(0.95) == 4
    ratio, low, high = ratio_interval([10.0, 10.1, 9.9], [15.0, 15.2, 14.9], 0.95)
    assert ratio == pytest.approx(1.5, rel=0.01) and (low, high) == (0.0, float("inf"))
    comparison = compare_documents(document({"1": [10.0, 10.1, 9.9]}), document({"1": [15.0, 15.2, 14.9]}))
    assert {c.verdict for c in comparison.changes} == {"too few iterations"} and not comparison.regressions
    assert any("at least 4 per side" in note for note in comparison.notes)


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
    """One process a side: the interval over the iterations is widened by 20% each way, so a 1.5x slowdown is a
    regression and a 1.25x one (which those iterations alone would bound beyond 5%) is not claimed."""
    rng = np.random.default_rng(2)
    base = {str(b): list(100 * b * rng.lognormal(0, 0.03, 9)) for b in (1, 2)}
    slower = {k: [t * 1.5 for t in v] for k, v in base.items()}
    assert len(compare_documents(document(base), document(slower)).regressions) == 2
    slow = compare_documents(document(base), document({k: [t * 1.25 for t in v] for k, v in base.items()}))
    totals = [c for c in slow.changes if c.metric == "total_ms"]
    assert not slow.regressions and all(c.ratio == pytest.approx(1.25) and c.low < 1.05 for c in totals)
    assert all(ratio_interval(v, [t * 1.25 for t in v], 0.95)[1] > 1.05 for v in base.values())  # unwidened: flagged
    slightly = {k: [t * 1.02 for t in v] for k, v in base.items()}  # within the 5% threshold
    assert not compare_documents(document(base), document(slightly)).regressions


# ---- processes as the units (issue 52) -------------------------------------------------------------------------

def test_a_planted_1_15x_slowdown_of_the_processes_is_flagged_and_same_code_processes_are_not():
    """Eight processes a side, 3% apart, three iterations each: in 20 planted pairs the 1.15x slowdown is a
    regression at least 19 times, and the same distribution on both sides never is."""
    rng = np.random.default_rng(52)
    flagged = same_flagged = 0
    for _ in range(20):
        before = document({"1": processes(rng, 8, between=0.03)})
        same = document({"1": processes(rng, 8, between=0.03)})
        slowed = document({"1": processes(rng, 8, between=0.03, scale=1.15)})
        changes = compare_documents(before, slowed).changes
        assert all(c.by_processes and c.processes == (8, 8) for c in changes)
        flagged += bool(compare_documents(before, slowed).regressions)
        same_flagged += bool(compare_documents(before, same).regressions)
    assert flagged >= 19 and same_flagged == 0


def test_the_spread_between_processes_is_judged_where_iterations_alone_would_flag_same_code():
    """The fault of issue 52: fresh processes of the same code 8% apart, each one's iterations within 1%. With one
    process a side, its iterations taken as the noise (as compare did before), some same-code pairs read as
    regressions beyond 5%; with six a side judged by processes, none does, and the comparison reports both spreads."""
    rng = np.random.default_rng(7)
    pooled = judged = 0
    spreads = []
    for _ in range(20):
        before, after = processes(rng, 6, between=0.08, iterations=6), processes(rng, 6, between=0.08, iterations=6)
        pooled += ratio_interval(before[0], after[0], 0.95)[1] > 1.05  # each side's first process alone
        comparison = compare_documents(document({"1": before}), document({"1": after}))
        judged += bool(comparison.regressions)
        change = comparison.changes[0]
        assert change.by_processes
        spreads.append((change.within[0], change.between[0]))
    assert pooled >= 2 and judged == 0
    within, between = np.median(spreads, axis=0)
    assert within < 0.02 < 0.05 < between


def test_one_process_a_side_says_the_spread_between_processes_is_unknown_and_widens(tmp_path, capsys, monkeypatch):
    """Two single processes 12% apart, each within 1%: the iterations alone bound the ratio beyond 5%, but they
    cannot show how far apart fresh processes are. compare widens the interval, says why, and claims nothing."""
    rng = np.random.default_rng(3)
    before = processes(rng, 1, between=0.0, iterations=6)[0]
    after = processes(rng, 1, between=0.0, iterations=6, scale=1.12)[0]
    assert ratio_interval(before, after, 0.95)[1] > 1.05  # what compare said before issue 52: a regression
    comparison = compare_documents(document({"1": before}), document({"1": after}))
    change = comparison.changes[0]
    assert not comparison.regressions and not change.by_processes and change.between == (None, None)
    assert change.low == pytest.approx(ratio_interval(before, after, 0.95)[1] / 1.2)
    assert "the spread between processes is unknown" in comparison.notes[0]
    assert "widened by 20% each way" in comparison.notes[0] and "--processes 4 or more" in comparison.notes[0]
    mixed = compare_documents(document({"1": before}), document({"1": processes(rng, 6, between=0.02)}))
    assert not mixed.changes[0].by_processes and "BEFORE 1 process and AFTER 6 processes" in mixed.notes[0]
    few = compare_documents(document({"1": processes(rng, 3, between=0.02)}),
                            document({"1": processes(rng, 3, between=0.02)}))
    assert "too little known to bound an interval over processes at 95%" in few.notes[0]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(document({"1": before})))
    b.write_text(json.dumps(document({"1": after})))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "spread between processes is unknown" in out and "judged over iterations, widened" in out
    assert "?/?" in table_rows(out)[0]


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
    assert main(["compare", a, str(tmp_path / "missing.json")]) == EXIT_BAD_INPUT


@pytest.mark.parametrize("version,said", [
    (3, "is schema_version 3, from an older release; this release reads versions 4 and 5: run the benchmark again "
        "with this release (or read the file with the one that wrote it)"),
    (6, "is schema_version 6, from another release; this release reads versions 4 and 5"),
    (None, "is not an opsd-rollout result (it has no schema_version)"),
])
def test_a_result_file_of_another_version_is_refused_in_one_line(tmp_path, capsys, version, said):
    """Not read, not upgraded: one line says what the file is and what to do."""
    planted = {k: v for k, v in document({"1": [10.0, 10.1, 9.9]}).items() if k != "schema_version"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(planted if version is None else {"schema_version": version, **planted}))
    assert main(["compare", str(path), str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"opsd-rollout: error: result file {str(path)!r} {said}") and err.count("\n") == 1, err


# ---- cases planted into a real result document ---------------------------------------------------------------

TOTAL_MS = 20.0
"""Each planted config's median total: a config that takes milliseconds."""
QUIET = {"host": "planted", "load_average": [0.1, 0.1], "cpu_count": 2, "wall_seconds": 0.2,
         "process_cpu_seconds": 0.4, "machine_busy_seconds": 0.41, "machine_seconds": 0.4, "steal_seconds": 0.0,
         "gpu_other_processes": None, "other_busy_cores": 0.05, "steal_fraction": 0.0, "reasons": [],
         "disturbed": False}
BUSY = {**QUIET, "load_average": [3.2, 3.4], "machine_busy_seconds": 0.66, "other_busy_cores": 1.3,
        "reasons": ["other processes kept 1.3 of 2 cores busy"], "disturbed": True}


@pytest.fixture(scope="module")
def real_document(tmp_path_factory):
    """One real run of the tiny model (two configs, two iterations each, any machine load)."""
    from opsd_rollout.bench.matrix import Matrix
    from opsd_rollout.bench.runner import BenchRunner
    from opsd_rollout.bench.scenarios import RolloutScenario, RolloutSettings

    output = tmp_path_factory.mktemp("compare") / "real.json"
    matrix = Matrix.parse(RolloutScenario, {"batch_sizes": [1, 2], "samples_per_prompt": [2], "prompt_lengths": [8],
                                            "response_lengths": [4], "zero_stages": ["none"]})
    BenchRunner(matrix, RolloutSettings(model="llama-tiny", warmup=0, iterations=2), output=output,
                measure_machine=False).run()
    document = json.loads(output.read_text())
    assert [r["status"] for r in document["results"]] == ["ok", "ok"]
    return document


def plant(document: dict, *, seed: int, scale: float = 1.0, iterations: int = 6, spread: float = 0.03,
          disturbed: str = "", processes: int = 1, between: float = 0.0) -> dict:
    """``document`` with planted iterations: each config's first real iteration, its times set so its total is
    ``TOTAL_MS``, repeated ``iterations`` times, every time of an iteration (but the reference workload's, the
    machine's) scaled by one lognormal factor
    (``spread``: its sigma) times ``scale`` (and its throughputs divided by it); its configs ``QUIET``, or
    ``BUSY`` where their key contains ``disturbed`` (``"-"``: every one). With ``processes`` over 1, each config
    is measured in that many processes of ``iterations`` each, each process's times scaled by one more lognormal
    factor (``between``: its sigma), merged as a run merges them."""
    from opsd_rollout.bench.processes import merge_processes

    document = copy.deepcopy(document)
    rng = np.random.default_rng(seed)
    document["settings"].update(iterations=iterations, processes=processes)
    for result in document["results"]:
        profile = result["iterations"][0]
        to_total = TOTAL_MS / profile["total_ms"]
        interference = dict(BUSY if disturbed and disturbed in result["key"] else QUIET)
        records = []
        for level in rng.lognormal(0.0, between, processes):
            planted = []
            for factor in rng.lognormal(0.0, spread, iterations) * scale * level:
                it = {k: v * to_total * factor if k.endswith("_ms") and k != REFERENCE_METRIC and v is not None
                      else v for k, v in profile.items()}  # the reference is the machine's: the code leaves it
                it.update({k: profile[k] / to_total / factor for k in profile if k.endswith("tokens_per_second")})
                planted.append(it)
            records.append({"pid": None, "iterations": planted, "warmup": result.get("warmup"),
                            "interference": interference, "derived": result["derived"], "warnings": []})
        measured = ConfigResult.from_dict(result, RolloutConfig)
        if processes == 1:
            measured.iterations, measured.interference = records[0]["iterations"], interference
        else:
            measured.processes = records
            merge_processes(measured)
        result.update({k: v for k, v in measured.to_dict().items() if k not in ("key", "config")})
    return document


def write(tmp_path, name: str, document: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return str(path)


def table_rows(out: str) -> list[str]:
    """The comparison table's rows: the lines after its header's rule, to the first blank one."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("──")) + 1
    return list(itertools.takewhile(str.strip, lines[start:]))


def header(out: str) -> str:
    return next(line for line in out.splitlines() if "metric" in line and "change" in line)


def test_planted_documents_are_valid_result_documents(real_document):
    several = plant(real_document, seed=1, iterations=3, processes=4, between=0.05, disturbed="B2-")
    jsonschema.validate(several, load_schema())
    result = several["results"][1]
    assert [len(p["iterations"]) for p in result["processes"]] == [3] * 4 and len(result["iterations"]) == 12
    assert result["interference"]["reasons"] == [f"process {k}: other processes kept 1.3 of 2 cores busy"
                                                 for k in range(1, 5)]
    planted = plant(real_document, seed=1, disturbed="B1-")
    jsonschema.validate(planted, load_schema())
    totals = [it["total_ms"] for it in planted["results"][0]["iterations"]]
    assert np.median(totals) == pytest.approx(TOTAL_MS, rel=0.05) and len(set(totals)) == 6
    assert [r["interference"]["disturbed"] for r in planted["results"]] == [True, False]


@pytest.mark.parametrize("where,name,value", [("settings", "model", "llama-small"), ("settings", "seed", 7),
                                              ("settings", "top_p", 0.9), ("environment", "world_size", 2)])
def test_files_of_different_work_are_refused_naming_what_differs(real_document, tmp_path, capsys, where, name, value):
    """The config keys carry no model (nor seed, sampling, ranks): two files that agree on every key can still
    have measured different work, and then a faster AFTER says nothing about the code."""
    before = plant(real_document, seed=1)
    after = plant(real_document, seed=2)
    after[where][name] = value
    with pytest.raises(MismatchError, match=name):
        compare_documents(before, after)
    a, b = write(tmp_path, "a.json", before), write(tmp_path, "b.json", after)
    assert main(["compare", a, b]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{name}: {before[where].get(name, 1)!r} in BEFORE, {value!r} in AFTER" in err
    assert f"--ignore-axes {name}" in err and "Traceback" not in err
    assert main(["compare", a, b, "--ignore-axes", name]) == 0  # asked for: compared, and said so
    assert "compared anyway" in capsys.readouterr().out


def test_how_a_config_was_measured_may_differ(real_document):
    """Warm-up and iteration counts change how a config is measured, not the work: files may differ in them."""
    after = plant(real_document, seed=2, iterations=9)
    after["settings"].update(warmup=None, warmup_max_iterations=4, steady_tolerance=0.02)
    comparison = compare_documents(plant(real_document, seed=1), after)
    assert comparison.matched == 2 and comparison.exit_status() == 0


def test_a_disturbed_config_is_flagged_and_not_judged_unless_asked(real_document, tmp_path, capsys):
    """On a busy machine a 10x 'speed-up' of the same code read as better: a config disturbed on either side is
    not evidence either way. Its rows say so, the exit status says so, and --allow-disturbed judges it."""
    before = write(tmp_path, "before.json", plant(real_document, seed=1, scale=10.0, disturbed="-"))
    same = write(tmp_path, "same.json", plant(real_document, seed=2))
    assert main(["compare", before, same]) == EXIT_DISTURBED
    out = capsys.readouterr().out
    assert "better" not in out and "2 of 2 compared config(s) were disturbed" in out
    assert "other processes kept 1.3 of 2 cores busy" in out
    rows = table_rows(out)
    assert len(rows) == 2 * 9 and all("disturbed" in row and row.rstrip().endswith("before") for row in rows)
    assert main(["compare", before, same, "--allow-disturbed"]) == 0
    assert "better" in capsys.readouterr().out

    slowed = plant(real_document, seed=2, scale=1.5, disturbed="B1-")  # one config disturbed, both slower
    comparison = compare_documents(plant(real_document, seed=1), slowed)
    assert comparison.disturbed == {"B1-n2-P8-R4-fp32-greedy-zeronone-static-retain-fwdon": "after"}
    assert {c.label for c in comparison.regressions} == {"B2 n2 P8 R4"}  # the judged one is a regression
    assert {c.verdict for c in comparison.changes if c.disturbed} == {"disturbed"}
    assert comparison.exit_status() == EXIT_REGRESSION
    allowed = compare_documents(plant(real_document, seed=1), slowed, allow_disturbed=True)
    assert {c.label for c in allowed.regressions} == {"B1 n2 P8 R4", "B2 n2 P8 R4"}


PLANTED_RUNS = [(5, 0.03, 1), (10, 0.03, 1), (3, 0.08, 5), (3, 0.03, 6)]
"""(iterations, spread inside a process, processes): one process a side judged over widened iterations, several
judged by processes (3% apart)."""


@pytest.mark.parametrize("iterations,spread,processes", PLANTED_RUNS)
def test_a_planted_1_5x_slowdown_is_a_regression(real_document, tmp_path, capsys, iterations, spread, processes):
    planted = {"iterations": iterations, "spread": spread, "processes": processes, "between": 0.03}
    before = write(tmp_path, "before.json", plant(real_document, seed=1, **planted))
    after = write(tmp_path, "after.json", plant(real_document, seed=2, scale=1.5, **planted))
    assert main(["compare", before, after, "--markdown", str(tmp_path / "cmp.md")]) == EXIT_REGRESSION
    assert "REGRESSION" in capsys.readouterr().out
    comparison = compare_documents(json.loads(open(before).read()), json.loads(open(after).read()))
    totals = [c for c in comparison.changes if c.metric == "total_ms"]
    assert len(totals) == 2 and all(c.regression and c.low > 1.05 for c in totals)
    assert "| total ms |" in (tmp_path / "cmp.md").read_text()


@pytest.mark.parametrize("iterations,spread,processes", PLANTED_RUNS)
def test_same_code_with_the_same_spread_is_no_regression(real_document, iterations, spread, processes):
    planted = {"iterations": iterations, "spread": spread, "processes": processes, "between": 0.03}
    comparison = compare_documents(plant(real_document, seed=1, **planted), plant(real_document, seed=2, **planted))
    assert comparison.matched == 2 and not comparison.regressions and comparison.exit_status() == 0
    assert all(c.by_processes == (processes > 1) for c in comparison.changes)


def test_compare_fits_80_columns(real_document, tmp_path, capsys, monkeypatch):
    """At COLUMNS=80 no line is wider (the table drops its medians, the footnote and notes wrap); wider, every
    column is there."""
    before = write(tmp_path, "before.json", plant(real_document, seed=1))
    after = write(tmp_path, "after.json", plant(real_document, seed=2, scale=1.5, disturbed="B1-"))
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["compare", before, after]) == EXIT_REGRESSION
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    assert "REGRESSION" in out and "Hodges-Lehmann" in out and len(table_rows(out)) == 2 * 9
    assert all(word in header(out) for word in ("config", "verdict", "disturbed"))
    monkeypatch.setenv("COLUMNS", "160")
    main(["compare", before, after])
    wide = header(capsys.readouterr().out)
    assert all(word in wide for word in ("before", "after", "CI", "verdict", "disturbed"))
