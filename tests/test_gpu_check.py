"""``scripts/gpu_check.py`` is run on a lent GPU in one call with minutes of device time, so its code must
be right before it gets there: the CPU rehearsal runs every check that needs no CUDA, as a user would."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_cpu_rehearsal_passes_what_a_cpu_can_run_and_skips_the_rest():
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--model", "llama-tiny"], env=clean_env(),
                            capture_output=True, text=True, timeout=480)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1]
            for line in result.stdout.splitlines() if line.startswith("| ") and " | " in line[2:]}
    rows.pop("check", None)
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = {name: "SKIP" if cuda_only else "PASS" for name, _check, cuda_only in module.CHECKS}
    assert rows == expected, result.stdout
    assert "PASS" in rows.values() and "SKIP" in rows.values()
