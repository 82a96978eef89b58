"""Numbers a user can trust: warm-up stops when a config is steady (and not before), the first call is kept
apart, a disturbed config is flagged, and a spread warning names its cause."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from opsd_rollout.bench import stability
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.runner import BenchRunner
from opsd_rollout.bench.scenarios import RolloutScenario, RolloutSettings
from opsd_rollout.bench.stability import (Interference, InterferenceMonitor, Warmup, merge_interference,
                                          spread_warning, warm_up)
from opsd_rollout.bench.stats import Stats


class ScriptedCalls:
    """A call whose durations (ms) follow a script, on a fake clock."""

    def __init__(self, durations_ms: list[float]):
        self.durations, self.now, self.calls = list(durations_ms), 0.0, 0

    def clock(self) -> float:
        return self.now

    def __call__(self) -> None:
        self.now += self.durations[min(self.calls, len(self.durations) - 1)] / 1e3
        self.calls += 1


SLOW_START = [11239, 13591, 1851, 1097, 1060, 1050, 1049]
"""The smoke matrix's first config in a fresh process, as a user saw it."""


def test_warm_up_runs_until_two_calls_agree_and_keeps_the_first_call_apart():
    calls = ScriptedCalls(SLOW_START)
    warmup = warm_up(calls, fixed=None, max_iterations=20, max_seconds=600, tolerance=0.05, clock=calls.clock)
    assert (warmup.iterations, warmup.steady) == (5, True)  # 1097 -> 1060 is the first pair within 5%
    assert warmup.first_call_ms == pytest.approx(11239) and warmup.times_ms[-1] == pytest.approx(1060)


@pytest.mark.parametrize("budget", [{"max_iterations": 3, "max_seconds": 600}, {"max_iterations": 20, "max_seconds": 20}])
def test_warm_up_stops_at_its_budget_and_says_it_was_not_steady(budget):
    calls = ScriptedCalls(SLOW_START)
    warmup = warm_up(calls, fixed=None, tolerance=0.05, clock=calls.clock, **budget)
    assert warmup.steady is False and warmup.iterations < 5


def test_a_fixed_warm_up_makes_exactly_that_many_calls():
    calls = ScriptedCalls(SLOW_START)
    assert warm_up(calls, fixed=2, max_iterations=20, max_seconds=600, tolerance=0.05, clock=calls.clock).iterations == 2
    calls = ScriptedCalls(SLOW_START)
    none = warm_up(calls, fixed=0, max_iterations=20, max_seconds=600, tolerance=0.05, clock=calls.clock)
    assert (none.iterations, none.first_call_ms, calls.calls) == (0, None, 0)


def test_ranks_keep_warming_up_until_every_rank_is_steady():
    calls = ScriptedCalls([100, 100, 100, 100, 100])
    votes = iter([False, False, False, True])  # another rank is still warming up
    warmup = warm_up(calls, fixed=None, max_iterations=20, max_seconds=600, tolerance=0.05, clock=calls.clock,
                     all_ranks=lambda done: next(votes))
    assert warmup.iterations == 3 and warmup.steady


def planted_monitor(other_busy_seconds: float, steal_seconds: float = 0.0) -> InterferenceMonitor:
    """A monitor over a fake machine of 2 cores and 1 s of wall time, where this process used 0.5 s of CPU."""
    monitor = InterferenceMonitor()
    clock, cpu, stat = iter([0.0, 1.0]), iter([0.0, 0.5]), iter([(0.0, 0.0, 0.0),
                                                                 (0.5 + other_busy_seconds, 2.0, steal_seconds)])
    monitor.clock, monitor.read_process_cpu, monitor.read_stat = (lambda: next(clock)), (lambda: next(cpu)), \
        (lambda: next(stat))
    monitor.read_gpu = lambda: None
    return monitor


def test_interference_is_flagged_with_its_cause():
    quiet = planted_monitor(other_busy_seconds=0.1)
    quiet.start()
    assert not quiet.stop().disturbed
    busy = planted_monitor(other_busy_seconds=1.5)
    busy.start()
    result = busy.stop()
    assert result.disturbed and result.other_busy_cores == pytest.approx(1.5)
    assert "other processes kept 1.5 of" in result.reasons[0]
    stolen = planted_monitor(other_busy_seconds=0.0, steal_seconds=0.3)
    stolen.start()
    assert "stole 15%" in stolen.stop().reasons[0]


def test_a_tick_of_the_counters_on_a_short_config_is_not_a_disturbance():
    """``/proc/stat`` counts in clock ticks (10 ms): one tick of steal or of another process in a config measured in
    90 ms is the counters' resolution, not a disturbance; the same shares over seconds are."""
    tick = 0.01

    def view(wall: float, steal: float, others: float) -> Interference:
        return Interference(host="h", cpu_count=2, wall_seconds=wall, process_cpu_seconds=wall * 1.5,
                            machine_busy_seconds=wall * 1.5 + others, machine_seconds=2 * wall,
                            steal_seconds=steal).judge()

    assert not view(0.09, tick, 0.0).disturbed and not view(0.0075, tick, tick).disturbed  # 5%, 50%; 1.3 cores
    assert view(0.09, 0.04, 0.0).reasons == ["the hypervisor stole 22% of the CPU time"]
    assert view(4.7, 1.32, 0.0).reasons == ["the hypervisor stole 14% of the CPU time"]  # make perf's B4 n4, measured
    assert view(2.0, 0.0, 1.2).reasons == ["other processes kept 0.6 of 2 cores busy"]


def test_a_runs_own_ranks_are_not_interference():
    """Two local ranks each see the other's CPU time as 'other'; merged, it is the run's own."""
    view = Interference(host="h", cpu_count=2, wall_seconds=1.0, process_cpu_seconds=0.9, machine_busy_seconds=1.8,
                        machine_seconds=2.0, steal_seconds=0.0).judge()
    assert view.disturbed  # seen from one rank
    assert not merge_interference([view, Interference(**{**vars(view), "process_cpu_seconds": 0.9})]).disturbed


def test_a_spread_warning_names_its_cause_and_remedy():
    noisy = Stats.from_values([100, 104, 130, 97, 125, 101])
    disturbed = Interference(reasons=["other processes kept 1.2 of 2 cores busy"])
    assert "interference (other processes kept 1.2" in spread_warning(noisy, Warmup(), disturbed, 0.05)
    cold = Stats.from_values([180, 160, 140, 100, 101, 99])
    assert "cold start" in spread_warning(cold, Warmup(steady=False), Interference(), 0.05)
    assert "ran out of budget" in spread_warning(cold, Warmup(steady=False), Interference(), 0.05)
    assert "real variance" in spread_warning(noisy, Warmup(steady=True), Interference(), 0.05)
    assert spread_warning(Stats.from_values([100, 101, 99, 100]), None, None, 0.05) is None


def test_a_disturbed_config_is_recorded_and_shown(tmp_path, monkeypatch, capsys):
    """A planted disturbance (the machine's busy time jumps by 10 CPU-seconds per reading) is flagged in the
    JSON, the table and a warning line."""
    readings = iter(range(0, 10**6, 10))
    monkeypatch.setattr(stability, "_proc_stat", lambda: (float(next(readings)), 1e9, 0.0))
    from opsd_rollout.cli import main

    code = main(["bench", "--model", "llama-tiny", "--batch-sizes", "1", "--samples-per-prompt", "1",
                 "--prompt-lengths", "8", "--response-lengths", "3", "--zero-stages", "none", "--iterations", "3",
                 "--output", str(tmp_path / "r.json")])
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert result["interference"]["disturbed"] and result["interference"]["other_busy_cores"] > 1
    assert result["warmup"]["iterations"] >= 2 and result["warmup"]["first_call_ms"] > 0
    out = capsys.readouterr().out
    assert "disturbed" in out and "other processes kept" in out


@pytest.mark.slow
def test_a_real_busy_neighbour_is_flagged(tmp_path):
    """Processes spinning while a config is measured: not ones the run started (their CPU time is the run's own, as
    a served teacher's server is), so they are left behind by a shell that exits at once. One spinner a core: with
    a single one on 2 cores the scheduler shared the cores among the spinner and the run's threads, and once gave the
    spinner under the limit's half a core (a CI run); with one a core the others' share is a core or more."""
    cores = psutil.cpu_count() or 1
    spin = f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!; " * cores
    shell = subprocess.run(["sh", "-c", spin], capture_output=True, text=True, check=True)
    spinners = [psutil.Process(int(pid)) for pid in shell.stdout.split()]
    assert len(spinners) == cores
    assert not {s.pid for s in spinners} & {c.pid for c in psutil.Process().children(recursive=True)}
    time.sleep(0.5)  # spinning before the config starts
    try:
        matrix = Matrix.parse(RolloutScenario, {"batch_sizes": [1], "samples_per_prompt": [1], "prompt_lengths": [8],
                                                "response_lengths": [16], "zero_stages": ["none"]})
        runner = BenchRunner(matrix, RolloutSettings(model="llama-tiny", warmup=1, iterations=8),
                             output=None, measure_machine=False)
        result = runner.run()[0]
    finally:
        for spinner in spinners:
            spinner.kill()
    assert result.interference["disturbed"], result.interference
