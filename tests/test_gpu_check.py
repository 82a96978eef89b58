"""``scripts/gpu_check.py`` is run on a lent GPU in one call with minutes of device time, so its code must
be right before it gets there: the CPU rehearsal runs every check that needs no CUDA, as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import clean_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_cpu_rehearsal_passes_what_a_cpu_can_run_and_skips_the_rest():
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--model", "llama-tiny"], env=clean_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1]
            for line in result.stdout.splitlines() if line.startswith("| ") and " | " in line[2:]}
    rows.pop("check", None)
    assert rows["strategies: equivalence and speed"] == "PASS"
    assert rows["ZeRO-3 gather: attribution, once vs per layer"] == "PASS"
    assert rows["compiled decode, profiled"] == "SKIP"
    assert "FAIL" not in rows.values()
