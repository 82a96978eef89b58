"""``train`` picks OpenMP's passive wait on shared cores (cores.py): when other processes keep at least half a core
busy as it starts; never over the user's own setting, not in a launcher's ranks, and not on cores of its own, where
the active wait is faster. The measurement is stood in for: these are the rules."""

from __future__ import annotations

import os

import pytest

from opsd_rollout import cores


@pytest.mark.parametrize("environ,busy,expected", [
    ({}, 0.1, None),                                       # a quiet machine: torch's default
    ({}, 0.5, "PASSIVE"),                                  # another process at half a core or more
    ({}, 1.9, "PASSIVE"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 1.9, None),            # the user's setting wins
    ({"LOCAL_RANK": "0"}, 1.9, None),                      # a launcher's rank: left as it is
])
def test_the_wait_policy_rules(environ, busy, expected):
    assert cores.wait_policy(environ, busy) == expected


@pytest.mark.parametrize("percent,expected", [(60.0, "PASSIVE"), (5.0, None)])
def test_share_cores_politely_sets_the_variable_from_what_it_measured(monkeypatch, percent, expected):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(cores.psutil, "cpu_percent", lambda interval: percent)
    monkeypatch.setattr(cores.os, "cpu_count", lambda: 2)
    assert cores.share_cores_politely() == expected
    assert os.environ.get("OMP_WAIT_POLICY") == expected


def test_train_decides_before_torch_and_bench_does_not():
    """The CLI asks for ``train`` only (a benchmark measures the machine as it is), and only while torch is not yet
    imported, since OpenMP reads the variable once."""
    from opsd_rollout.cli import shares_cores

    assert shares_cores("train", {"json": None})
    assert not shares_cores("train", {"torch": None})
    assert not shares_cores("bench", {"json": None}) and not shares_cores("step", {})
