"""``scripts/compare_upstream.py`` is how RESULTS.md's side-by-side figures are made: it must run as the README
says, and its length model must reach every contender alike (greedy rows of the same content get the same
forced lengths in ours, DeepSpeed's rollout and transformers' generate)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, run_named

pytestmark = pytest.mark.slow  # each test starts the script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_upstream.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return run_named(f"compare_upstream.py {' '.join(args)} (seconds on 2 quiet cores)",
                     [sys.executable, str(SCRIPT), "--model", "llama-tiny", *args], env=clean_env(), timeout=900)


def table(stdout: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in (
        [cell.strip() for cell in line.strip("|").split("|")] for line in stdout.splitlines() if line.startswith("| "))
        if cells[0] != "rollout"}


def test_forced_lengths_reach_every_contender_and_continuous_batching_is_compared():
    result = run("--shapes", "2x2x8x20", "--lengths", "geometric:mean=5", "--rounds", "1",
                 "--contenders", "static,static-no-compaction,deepspeed,transformers", "--continuous", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table(result.stdout)
    assert list(rows) == ["opsd static", "opsd static, no row compaction", "DeepSpeed HybridEngineRollout",
                          "transformers generate", "opsd static, continuous_batch_size=2",
                          "opsd static, calls of 2 rows one after another"]
    real_tokens = {name: int(cells[1]) for name, cells in rows.items()}
    assert len(set(real_tokens.values())) == 1, real_tokens  # greedy: same rows, same forced lengths
    assert 4 <= real_tokens["opsd static"] < 4 * 20  # forced: not every row ran to the cap
    assert rows["DeepSpeed HybridEngineRollout"][3] == "1.00x"


def test_a_wrong_argument_is_named_before_any_model_loads():
    for args, message in ((["--contenders", "static,nope", "--lengths", "lognormal:median=4"], "--lengths"),
                          (["--continuous", "0"], "--continuous must be at least 1")):
        result = run(*args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
