"""The command line answers at once and fits the terminal: the commands that run no work (help, ``models``, dry
runs, bad input) import neither DeepSpeed nor transformers' model code; every table fits the width it is
printed at (folding columns rather than cutting numbers); titles break between phrases; DeepSpeed's
CPU-fallback warning shows only with ``-v``; the progress line says what a long first step is doing; a dry
run estimates from the last result at the output path."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import sys

import pytest
from rich.console import Console
from rich.progress import Progress

from conftest import run_named
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.report import SCHEMA_VERSION, ConfigResult
from opsd_rollout.bench.tables import CompactTable, PhraseText, fold_columns
from opsd_rollout.bench.scenarios import RolloutScenario, StepScenario
from opsd_rollout.bench.session import BUILDING, FIRST_CALL, ProgressLine, print_dry_run
from opsd_rollout.cli import main
from opsd_rollout.cli.common import CpuFallbackFilter, show_accelerator_fallback
from opsd_rollout.metrics import METRICS
from opsd_rollout.presets import PRESETS

WIDTH = 80
BIG = 98765.4
"""A planted time wide enough ("98,765.4") that a table of them needs folding at 80 columns."""


def rendered(renderables, width: int = WIDTH) -> list[str]:
    """The lines a console ``width`` wide prints for ``renderables``."""
    console = Console(width=width, record=True, file=io.StringIO())
    for renderable in renderables:
        console.print(renderable)
    return console.export_text().splitlines()


def assert_fits(lines: list[str], width: int = WIDTH) -> None:
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, f"{len(too_wide)} line(s) wider than {width}: {too_wide[:3]}"
    assert not any("…" in line for line in lines), "a cell was cut"


# ---- the structural property behind "answers within 2 s": what a light command imports --------------------------

LIGHT_COMMANDS = [["--help"], ["bench", "--help"], ["step", "--help"], ["compare", "--help"], ["models", "--help"],
                  ["train", "--help"], ["models"], ["bench", "--model", "llama-tiny", "--dry-run"], ["step", "--dry-run"],
                  ["bench", "--iterations", "0"], ["bench", "--batch-sizes", "0,x"], ["bench", "--model", "org/x"],
                  ["bench", "--warmup", "soon"], ["serve-teacher", "--help"], ["serve-teacher", "--model", "org/x"],
                  ["serve-teacher", "--model", "llama-tiny", "--port", "-1"], ["eval", "--help"],
                  ["train", "--output-dir", "o", "--steps", "0"],
                  ["train", "--output-dir", "o", "--lora-rank", "0", "--teacher", "llama-mini"],
                  ["train", "--output-dir", "o", "--teacher", "qwen2-0.5b"],
                  ["train", "--output-dir", "o", "--teacher", "llama-mini", "--prompts", "missing.jsonl"],
                  ["train", "--output-dir", "o", "--teacher", "llama-mini", "--eval-data", "missing.jsonl",
                   "--eval-scorer", "gsm8k"],
                  ["eval", "--model", "llama-tiny", "--eval-data", "missing.jsonl", "--eval-scorer", "gsm8k"]]
CHILD = """
import sys
from opsd_rollout.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
sys.stderr.write("\\nMODULES " + " ".join(sorted(sys.modules)) + "\\n")
"""


@pytest.mark.slow
@pytest.mark.parametrize("argv", LIGHT_COMMANDS, ids=" ".join)
def test_light_commands_import_no_deepspeed_torch_or_transformers(argv):
    """Seconds of imports (DeepSpeed alone ~19 s on a busy machine) for a command that runs nothing: checked by
    what a fresh interpreter has loaded after the command's ``main``, not by its time (machine speed)."""
    result = run_named(f"opsd-rollout {' '.join(argv)} in a fresh interpreter (under a second on 2 quiet cores)",
                       [sys.executable, "-c", CHILD, *argv], timeout=120)
    modules = result.stderr.rsplit("MODULES ", 1)[-1].split()
    assert "opsd_rollout.cli" in modules, result.stderr[-2000:]
    heavy = [m for m in modules if m.split(".")[0] in ("deepspeed", "torch", "transformers")]
    assert not heavy, f"`{' '.join(argv)}` imported {heavy[:8]}: import them inside the function that runs work"


@pytest.mark.slow
def test_deepspeeds_cpu_fallback_warning_shows_only_when_verbose():
    """The real DeepSpeed, on a machine where it finds no accelerator: its warning is dropped without ``-v``
    (``show_accelerator_fallback(False)``, installed before DeepSpeed is imported) and shown with it."""
    child = """
from opsd_rollout.cli.common import show_accelerator_fallback
show_accelerator_fallback(False)
import deepspeed.accelerator.real_accelerator as real  # DeepSpeed detects its accelerator as it is imported
real.get_accelerator()
print("VERBOSE", flush=True)
real.ds_accelerator = None  # detect again
show_accelerator_fallback(True)
real.get_accelerator()
"""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    result = run_named("importing DeepSpeed and detecting its accelerator (seconds on 2 quiet cores)",
                       [sys.executable, "-c", child], timeout=600, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    quiet, verbose = result.stdout.split("VERBOSE")
    assert "Setting accelerator to CPU" not in quiet
    assert "Setting accelerator to CPU" in verbose, result.stdout


def test_the_fallback_filter_drops_that_warning_alone():
    logger = logging.getLogger("DeepSpeed")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        show_accelerator_fallback(False)
        show_accelerator_fallback(False)  # once is enough
        assert sum(isinstance(f, CpuFallbackFilter) for f in logger.filters) == 1
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("something else")
        assert seen == ["something else"]
        show_accelerator_fallback(True)
        logger.warning("Setting accelerator to CPU. If you have GPU ...")
        assert seen[-1].startswith("Setting accelerator to CPU")
    finally:
        logger.removeHandler(handler)
        show_accelerator_fallback(True)


# ---- widths ------------------------------------------------------------------------------------------------------

def test_models_fits_80_columns_and_counts_without_building(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert_fits(lines)
    text = "\n".join(lines)
    for name in PRESETS:
        assert name in text
    assert "494.03M" in text and "1.24B" in text and "llama-small (default)" in text


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_counts_from_the_config_numbers_match_the_built_model(name):
    preset = PRESETS[name]
    assert preset.num_parameters() == sum(p.numel() for p in preset.build(device="meta").parameters())
    config = preset.make_config()
    assert preset.max_positions == (getattr(config, "max_position_embeddings", None) or config.n_positions)


def planted_results(scenario, axes) -> list[ConfigResult]:
    """Every config of the matrix measured with wide planted figures, the first one failed."""
    from opsd_rollout.profiling.profile import RolloutProfile

    def iteration(i: int) -> dict:
        figures = {f.name: BIG + i for f in dataclasses.fields(RolloutProfile)}
        figures.update(live_row_utilisation=0.5, workspace=None)
        if scenario is StepScenario:
            figures.update({name: BIG + i for name in METRICS}, rollout_share=0.5, loss=1.2345)
        return figures

    results = [ConfigResult(config=c, status="ok", iterations=[iteration(i) for i in range(5)],
                            warmup={"iterations": 10, "first_call_ms": 123456.7, "steady": False})
               for c in Matrix.parse(scenario, axes).expand()]
    results[0].status, results[0].error = "failed", "RuntimeError: planted"
    return results


@pytest.mark.parametrize("width", [WIDTH, 60, 120])
@pytest.mark.parametrize("scenario,axes", [
    (RolloutScenario, {"length_models": ["fixed", "natural"], "dtypes": ["fp32", "bf16"]}),
    (StepScenario, {"losses": ["jsd", "reverse_kl"]}),
])
def test_every_result_table_fits_the_width_and_keeps_every_figure(scenario, axes, width):
    results = planted_results(scenario, axes)
    run = scenario(scenario.settings_type())
    title = run.title({"device_name": "NVIDIA H200 141GB HBM3e", "threads": 16, "cpu_count": 16,
                       "threads_source": "shared", "local_ranks": 4}, 4)
    tables = run.tables(results)
    lines = rendered([PhraseText(title), *tables], width)
    assert_fits(lines, width)
    text = "\n".join(lines)
    assert "failed (see below)" in text
    for table in tables:  # every value column made it, folded or not
        for header in table.headers[1:]:
            assert header.split("\n")[-1] in text


def test_a_wide_table_folds_its_value_columns_under_each_other():
    rows = [([f"B{b} n4 P128 R32 bf16/natural", *[f"{BIG:,.1f}"] * 9], None) for b in (1, 4)]
    table = CompactTable("nine times", ["config", *[f"stage{i} ms" for i in range(9)]], rows)
    lines = rendered([table])
    assert_fits(lines)
    assert sum(line.lstrip().startswith("config") for line in lines) == 2  # two parts, the labels in each
    assert sum(f"{BIG:,.1f}" in line for line in lines) >= 4 and "stage8" in "\n".join(lines)


def test_fold_columns_makes_even_groups_only_when_needed():
    assert fold_columns(16, [8] * 4, 80) == [range(0, 4)]
    assert fold_columns(16, [8] * 7, 80) == [range(0, 4), range(4, 7)]
    assert fold_columns(16, [70], 40) == [range(0, 1)]  # wider than anything: one column a part


def test_titles_break_between_phrases():
    title = ("llama-small on NVIDIA H200 141GB HBM3e (16 threads per rank), 5 iterations after warm-up until "
             "steady; 4 ranks: batch sizes are per rank, times are the slowest rank's, tokens/s the sum over ranks")
    lines = PhraseText(title).lines(WIDTH)
    assert all(len(line) <= WIDTH for line in lines) and len(lines) == 3
    assert any("5 iterations after warm-up until steady;" in line for line in lines)
    dry = "4 configs on llama-small: warm-up until steady (at most 10 calls, 60 s), then 5 iterations each"
    assert any("(at most 10 calls, 60 s)" in line for line in PhraseText(dry).lines(60))
    assert " ".join(PhraseText(title).lines(20)).split() == title.split()  # nothing lost when phrases wrap


def test_warnings_wrap_at_the_console_width():
    from opsd_rollout.bench.session import note

    message = "total_ms spread (IQR/median) is 97%, over 10%: interference (other processes kept 1.0 of 2 cores " \
              "busy); rerun when the machine is quiet [N, R, V]"
    lines = rendered([note("warning", "yellow", "B4 n1 P8 R4 zeronone", message)])
    assert_fits(lines)
    assert len(lines) >= 2 and "[N, R, V]" in "\n".join(lines)  # wrapped, and brackets are not markup


# ---- the dry run's estimate ----------------------------------------------------------------------------------------

TINY = ["--model", "llama-tiny", "--prompt-lengths", "8", "--response-lengths", "4", "--warmup", "0",
        "--iterations", "2", "--zero-stages", "none", "--batch-sizes", "1,2"]


def previous_document(kind: str, scenario, axes, total_ms: float = 1000.0) -> dict:
    """A result file as a finished run leaves it: every config ok, each iteration ``total_ms``."""
    results = [ConfigResult(config=c, status="ok", iterations=[{"total_ms": total_ms}] * 3).to_dict()
               for c in Matrix.parse(scenario, axes).expand()]
    return {"schema_version": SCHEMA_VERSION, "kind": kind, "environment": None, "matrix": {}, "settings": {},
            "results": results}


def tiny_axes() -> dict:
    return {"prompt_lengths": [8], "response_lengths": [4], "zero_stages": ["none"], "batch_sizes": [1, 2]}


def test_dry_run_estimates_from_the_last_result_at_the_default_output(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    (tmp_path / "bench-results").mkdir()
    (tmp_path / "bench-results" / "rollout.json").write_text(json.dumps(
        previous_document("rollout", RolloutScenario, tiny_axes())))
    assert main(["bench", *TINY, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert_fits(out.splitlines())
    assert "from bench-results/rollout.json" in " ".join(out.split())
    assert "estimated duration: 8.0 s for 4 of 4 configs" in " ".join(out.split())  # 4 x 2 iterations x 1 s


@pytest.mark.parametrize("content", ["{not json", json.dumps(previous_document("step", StepScenario, {}))])
def test_an_unusable_file_at_the_output_path_is_no_estimate_and_no_error(tmp_path, monkeypatch, capsys, content):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench-results").mkdir()
    (tmp_path / "bench-results" / "rollout.json").write_text(content)
    assert main(["bench", *TINY, "--dry-run"]) == 0
    assert "unknown without a previous result" in " ".join(capsys.readouterr().out.split())


def test_dry_run_says_when_the_previous_result_has_none_of_these_configs():
    settings = RolloutScenario.settings_type(model="llama-tiny", warmup=0, iterations=2)
    matrix = Matrix.parse(RolloutScenario, {**tiny_axes(), "batch_sizes": [8]})
    console = Console(width=WIDTH, record=True, file=io.StringIO())
    print_dry_run(matrix, settings, previous_document("rollout", RolloutScenario, tiny_axes()), console, "old.json")
    assert "unknown: old.json has no finished result" in " ".join(console.export_text().split())


# ---- the progress line ----------------------------------------------------------------------------------------------

def test_the_progress_line_says_what_a_long_first_step_is_doing():
    settings = RolloutScenario.settings_type(model="llama-tiny", iterations=2)
    configs = Matrix.parse(RolloutScenario, {**tiny_axes(), "zero_stages": ["none", "0"]}).expand()
    with Progress(console=Console(file=io.StringIO(), width=WIDTH), auto_refresh=False) as bar:
        line = ProgressLine(bar, settings, len(configs), first_status="measuring")

        def task(task_id):
            return next(t for t in bar.tasks if t.id == task_id)

        def status() -> str:
            return task(line.iterations).description

        assert status() == "measuring"
        first, same_engine = [c for c in configs if c.zero_stage == "none"][:2]
        other_engine = next(c for c in configs if c.zero_stage != "none")
        line("config", first, 0)
        assert status() == BUILDING  # a new engine: loading the model, wrapping it, then the first call
        line("first_call", first, 0)
        assert status() == FIRST_CALL
        line("warmup", first, 1)
        assert status() == "warming up: 1 of at most 10 calls done"
        line("iteration", first, 1)
        line("iteration", first, 2)
        assert status() == "iterations" and task(line.configs).completed == 1
        line("config", same_engine, 0)
        assert status() == FIRST_CALL  # its engine is built already
        line("config", other_engine, 0)
        assert status() == BUILDING
        line.status("anything else")
        assert status() == "anything else"
