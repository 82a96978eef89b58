"""Each rank's thread count under a launcher: the local ranks share the cores unless OMP_NUM_THREADS chose a
count (torchrun's own default of 1 is not a choice), and the title says what was used and why."""

from __future__ import annotations

import os

import pytest
import torch

from opsd_rollout.bench import threads as threads_module
from opsd_rollout.bench.scenarios.base import threads_phrase
from opsd_rollout.bench.threads import Threads, share_cores

CORES = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def launcher_env(monkeypatch):
    """No launcher variables from the test run itself; torch's thread count restored after each test."""
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)


@pytest.mark.parametrize("variable", ["LOCAL_SIZE", "LOCAL_WORLD_SIZE"])  # DeepSpeed's launcher, torchrun
def test_local_ranks_divide_the_cores(launcher_env, variable):
    launcher_env.setenv(variable, "2")
    torch.set_num_threads(CORES)  # what the DeepSpeed launcher leaves each rank
    assert share_cores() == Threads(per_rank=max(1, CORES // 2), local_ranks=2, cores=CORES, source="shared")
    assert torch.get_num_threads() == max(1, CORES // 2)


def test_more_local_ranks_than_cores_still_get_one_thread_each(launcher_env):
    launcher_env.setenv("LOCAL_SIZE", str(CORES * 2))
    assert share_cores().per_rank == 1


def test_omp_num_threads_is_a_choice_that_stands(launcher_env):
    launcher_env.setenv("LOCAL_SIZE", "2")
    launcher_env.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert share_cores() == Threads(per_rank=1, local_ranks=2, cores=CORES, source="OMP_NUM_THREADS")


def test_one_rank_keeps_torchs_default(launcher_env):
    torch.set_num_threads(1)
    assert share_cores() == Threads(per_rank=1, local_ranks=1, cores=CORES, source="torch")


@pytest.mark.parametrize("parent,expected", [(b"PATH=/bin\0HOME=/root\0", "shared"),  # torchrun set the 1
                                             (b"PATH=/bin\0OMP_NUM_THREADS=1\0", "OMP_NUM_THREADS"),  # you did
                                             (None, "OMP_NUM_THREADS")])  # cannot tell: the variable stands
def test_torchruns_default_of_one_thread_is_replaced_by_the_share(launcher_env, parent, expected):
    launcher_env.setenv("LOCAL_WORLD_SIZE", "2")
    launcher_env.setenv("TORCHELASTIC_RUN_ID", "none")
    launcher_env.setenv("OMP_NUM_THREADS", "1")
    launcher_env.setattr(threads_module, "_parent_environment", lambda: parent)
    torch.set_num_threads(1)
    assert share_cores().source == expected
    assert torch.get_num_threads() == (max(1, CORES // 2) if expected == "shared" else 1)


@pytest.mark.parametrize("environment,world_size,phrase", [
    ({"threads": 1, "threads_source": "shared", "local_ranks": 2, "cpu_count": 2}, 2,
     "1 thread per rank: 2 cores / 2 local ranks"),
    ({"threads": 4, "threads_source": "OMP_NUM_THREADS", "local_ranks": 2, "cpu_count": 16}, 2,
     "4 threads per rank from OMP_NUM_THREADS, 2 local ranks"),
    ({"threads": 2, "threads_source": "torch", "local_ranks": 1, "cpu_count": 2}, 1, "2 threads"),
    ({"threads": 3}, 1, "3 threads"),  # a result written before the source was recorded
])
def test_the_title_says_the_threads_and_why(environment, world_size, phrase):
    assert threads_phrase(environment, world_size) == phrase
