"""Load on one teacher server (issue 35, part 7): 8 concurrent clients, the ranks of a run, send a bounded number of
requests to ``opsd-rollout serve-teacher`` in its own process; every response equals the teacher computed locally,
the latency percentiles and the server's memory are reported, and its memory is flat after warm-up
(``benchmarks/serve/serve_load.py --check``, the reproducer of the committed load results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import clean_env, run_named

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve" / "serve_load.py"


@pytest.mark.slow
def test_eight_clients_get_correct_answers_and_the_servers_memory_stays_flat(tmp_path):
    output = tmp_path / "load.json"
    done = run_named("the load script", [sys.executable, str(SCRIPT), "--model", "llama-tiny", "--clients", "8",
                                         "--requests", "12", "--warmup", "3", "--tokens", "48", "--output",
                                         str(output), "--check"], timeout=900, env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["requests"] == result["correct"] == 96 and result["wrong"] == []
    latency = result["latency_ms"]
    assert latency["count"] == 8 * 9 and 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
    memory = result["server_rss_mib"]
    assert memory["growth_after_warmup"] <= 32 and memory["peak"] >= memory["at_ready"] > 0
    assert len(result["rss_over_time"]) >= 2
