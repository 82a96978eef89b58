"""The library is as quiet as the command line: ``train(TrainConfig(...))`` shows neither DeepSpeed's CPU-fallback
line nor transformers' progress bars unless ``verbose``, and leaves both libraries' settings as it found them (no
process-wide change the caller did not ask for)."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from conftest import run_named
from opsd_rollout.quiet import CpuFallbackFilter, cpu_fallback_hidden, progress_bars_hidden
from opsd_rollout.train import TrainConfig, train
from test_train import write_prompts

BAR = "Writing model shards"
"""What transformers' progress bar says as ``save_pretrained`` writes the final model."""


@pytest.mark.parametrize("verbose", [False, True])
def test_train_hides_transformers_progress_bars_unless_verbose_and_puts_the_setting_back(tmp_path, capfd, verbose):
    from transformers.utils import logging as transformers_logging

    assert transformers_logging.is_progress_bar_enabled()
    train(TrainConfig.from_flat(dict(output_dir=str(tmp_path / "run"), student="llama-tiny", teacher="qwen2-tiny",
                                     prompts=str(write_prompts(tmp_path / "p.jsonl")), steps=1,
                                     prompts_per_micro_batch=2, max_new_tokens=4, eval_prompts=2, progress=False,
                                     verbose=verbose)))
    assert (BAR in capfd.readouterr().err) == verbose
    assert transformers_logging.is_progress_bar_enabled()


def test_the_scopes_restore_what_they_found():
    from transformers.utils import logging as transformers_logging

    logger = logging.getLogger("DeepSpeed")
    before = list(logger.filters)
    with cpu_fallback_hidden():
        assert sum(isinstance(f, CpuFallbackFilter) for f in logger.filters) == 1
        with cpu_fallback_hidden():  # nested: one filter
            assert sum(isinstance(f, CpuFallbackFilter) for f in logger.filters) == 1
    assert logger.filters == before
    transformers_logging.disable_progress_bar()
    try:
        with progress_bars_hidden():
            assert not transformers_logging.is_progress_bar_enabled()
        assert not transformers_logging.is_progress_bar_enabled()  # off before: off after
    finally:
        transformers_logging.enable_progress_bar()


@pytest.mark.slow
def test_importing_the_training_names_imports_deepspeed_without_its_cpu_fallback_line():
    """The real DeepSpeed on a machine where it finds no accelerator: its line is logged as it is first imported,
    which for a library caller is ``from opsd_rollout.train import ...``; importing DeepSpeed first shows it."""
    child = """
import logging
from opsd_rollout.train import TrainConfig
assert "deepspeed" in __import__("sys").modules
assert not logging.getLogger("DeepSpeed").filters, "a filter left behind"
print("FIRST", flush=True)
import deepspeed.accelerator.real_accelerator as real
real.ds_accelerator = None  # detect again, as a process that imported DeepSpeed itself first would
real.get_accelerator()
"""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    result = run_named("importing the training names and DeepSpeed (seconds on 2 quiet cores)",
                       [sys.executable, "-c", child], timeout=600, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    ours, theirs = result.stdout.split("FIRST")  # DeepSpeed logs to stdout
    assert "Setting accelerator to CPU" not in ours and "Setting accelerator to CPU" in theirs, result.stdout
