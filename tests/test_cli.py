"""The command line: subcommands, help, and one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from opsd_rollout.cli import main


def test_models_lists_every_preset(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("llama-tiny", "llama-small", "qwen2-small", "gpt2-tiny"):
        assert name in out


def test_bench_prints_a_stage_table_for_a_tiny_model(capsys, tmp_path):
    assert main(["bench", "--model", "llama-tiny", "--batch-sizes", "2", "--samples-per-prompt", "2",
                 "--prompt-lengths", "8", "--response-lengths", "4", "--warmup", "0", "--iterations", "2",
                 "--output", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    for column in ("TTFT ms", "TPOT ms", "prefill %", "decode %", "B2 n2 P8 R4"):
        assert column in out


def test_bad_model_is_one_clear_line(capsys):
    assert main(["bench", "--model", "org/some-hub-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opsd-rollout: error:") and "never downloads" in err and "Traceback" not in err


@pytest.mark.slow
def test_python_dash_m_help_works():
    result = subprocess.run([sys.executable, "-m", "opsd_rollout", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "bench" in result.stdout and "models" in result.stdout


def test_unknown_subcommand_exits_2():
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
