"""The command line: subcommands, help, and one-line errors for bad input."""

from __future__ import annotations

import sys

import pytest

from conftest import run_named
from opsd_rollout.cli import main


def test_models_lists_every_preset(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("llama-tiny", "llama-small", "qwen2-small", "gpt2-tiny", "qwen2-0.5b", "llama-1b"):
        assert name in out
    for count in ("494.03M", "1.24B", "151,936", "128,256"):  # parameter counts and vocabularies
        assert count in out


def test_bench_prints_a_stage_table_for_a_tiny_model(capsys, tmp_path):
    assert main(["bench", "--model", "llama-tiny", "--batch-sizes", "2", "--samples-per-prompt", "2",
                 "--prompt-lengths", "8", "--response-lengths", "4", "--warmup", "0", "--iterations", "2",
                 "--output", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    for column in ("TTFT", "TPOT", "where the time goes", "prefill", "decode", "B2 n2 P8 R4", "warm-up", "1st"):
        assert column in out


def test_bad_model_is_one_clear_line(capsys):
    assert main(["bench", "--model", "org/some-hub-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opsd-rollout: error:") and "never downloads" in err and "Traceback" not in err


@pytest.mark.slow
def test_python_dash_m_help_works():
    result = run_named("python -m opsd_rollout --help (seconds on 2 quiet cores)",
                       [sys.executable, "-m", "opsd_rollout", "--help"], timeout=600)
    assert result.returncode == 0 and "bench" in result.stdout and "models" in result.stdout


@pytest.mark.parametrize("command", [[], ["bench"], ["step"], ["train"], ["compare"], ["models"],
                                     ["eval"]])
def test_every_help_page_prints(command, capsys):
    """argparse formats help lazily: a stray ``%`` in a help text only fails when someone asks for --help."""
    from opsd_rollout.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--help"])
    assert exit_info.value.code == 0 and "usage: opsd-rollout" in capsys.readouterr().out


def test_unknown_subcommand_exits_2():
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("argv,said", [
    (["train", "--output-dir", "o", "--loss", "kl"], "argument --loss: invalid choice: 'kl' (choose from "
                                                     "'forward_kl', 'reverse_kl', 'jsd', 'sampled_reverse_kl')"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate' (choose from 'models', 'bench'"),
    (["eval", "--model", "m"], "the following arguments are required: --eval-data, --eval-scorer"),
    (["serve-teacher", "--model", "m", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["bench", "--zero-stages"], "argument --zero-stages: expected one argument"),
    (["step", "--teacher-caches", "full", "--nope"], "unrecognized arguments: --nope"),
    (["compare", "a.json"], "the following arguments are required: AFTER.json"),
    (["models", "--all"], "unrecognized arguments: --all"),
])
def test_a_parser_error_is_one_line_with_every_errors_prefix(argv, said, capsys):
    """argparse printed the whole usage (26 lines for train) before its error, under the subcommand's name; every
    subcommand's parser now says its error alone, as every other refusal does."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("opsd-rollout: error: ")
    assert said in err and err.count("\n") == 1 and "usage:" not in err, err


def documentation() -> str:
    """The README and every page of docs/, where the commands users copy are."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return "\n".join(page.read_text() for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))])


def test_every_documented_command_matches_the_parser():
    """Each ``opsd-rollout`` command in the README's and docs/'s shell blocks parses with today's flags."""
    import re
    import shlex

    from opsd_rollout.cli import build_parser

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", documentation(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#")[0].split(";"):
                words = shlex.split(part)
                if "..." not in part and words[:1] == ["opsd-rollout"]:
                    commands.append(words[1:])
    assert len(commands) >= 8, commands
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as error:  # --help and --version exit 0; a bad flag exits 2
            assert error.code == 0, f"documented command does not parse: opsd-rollout {' '.join(argv)}"


@pytest.mark.parametrize("argv,local_rank", [
    (["--local_rank=0", "bench", "--zero-stages", "3"], 0),  # what the DeepSpeed launcher passes
    (["--local-rank", "1", "step", "--zero-stages", "3"], 1),
    (["bench", "--local_rank=1", "--zero-stages", "3"], 1),
    (["bench", "--local-rank=0"], 0),
    (["--local_rank=0", "step", "--local_rank=1"], 1),  # the subcommand's is the later one
    (["bench", "--zero-stages", "3"], None),
])
def test_local_rank_is_accepted_before_and_after_the_subcommand(argv, local_rank):
    from opsd_rollout.cli import build_parser

    args = build_parser().parse_args(argv)
    assert getattr(args, "local_rank", None) == local_rank
    assert args.command == next(a for a in argv if a in ("bench", "step"))


def test_local_rank_fills_in_the_environment_and_must_agree_with_it(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["--local_rank=0", "models"]) == 0
    import os

    assert os.environ["LOCAL_RANK"] == "0"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["--local_rank=0", "models"]) == 2
    assert "--local_rank=0 disagrees with LOCAL_RANK=1" in capsys.readouterr().err


def test_local_rank_is_not_passed_on_when_nproc_relaunches():
    from opsd_rollout.cli.bench import _relaunch_argv

    assert _relaunch_argv(["--local_rank=0", "bench", "--nproc", "2", "--local-rank", "3", "--nproc=4",
                           "--zero-stages", "3"]) == ["bench", "--zero-stages", "3"]


def test_the_documented_launcher_commands_parse_as_the_launcher_runs_them():
    """``deepspeed ... --module opsd_rollout ARGS`` runs ``python -m opsd_rollout --local_rank=N ARGS``."""
    import re
    import shlex

    from opsd_rollout.cli import build_parser

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", documentation(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#")[0].replace("...", ""))
            if words[:1] == ["deepspeed"] and "opsd_rollout" in words:
                commands.append(["--local_rank=0", *words[words.index("opsd_rollout") + 1:]])
    assert commands, "the docs show the DeepSpeed launcher (docs/MULTIRANK.md)"
    for argv in commands:
        build_parser().parse_args(argv)


# ---- one name, one meaning ------------------------------------------------------------------------------------------

def visible_flags() -> dict[str, dict[str, object]]:
    """Each subcommand's flags as ``--help`` shows them (the launcher's ``--local_rank`` is hidden) -> their action."""
    import argparse

    from opsd_rollout.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {option: action for action in parser._actions for option in action.option_strings
                   if action.help is not argparse.SUPPRESS}
            for name, parser in sub.choices.items()}


def test_a_flag_has_one_type_in_every_subcommand():
    """A list (a benchmark's axis) in one subcommand and one value in another, or another type or other choices:
    the same name is one kind of value everywhere. ``--samples-per-prompt`` alone is a benchmark axis that lists
    the values of ``train``'s flag of that name (docs/BENCHMARKS.md)."""
    kinds: dict[str, dict[str, object]] = {}
    for command, flags in visible_flags().items():
        for option, action in flags.items():
            kind = "list" if action.metavar == "LIST" else (getattr(action.type, "__name__", action.type),
                                                           tuple(action.choices or ()), action.nargs)
            kinds.setdefault(option, {})[command] = kind
    mixed = {option: seen for option, seen in kinds.items() if len(set(seen.values())) > 1}
    assert set(mixed) == {"--samples-per-prompt"}, mixed
    assert mixed["--samples-per-prompt"]["train"] == ("int", (), None)


def test_train_flags_set_the_train_config_fields_of_their_names():
    """A flag's name is the field it sets: TrainConfig's own, or its section's field (``--loss`` sets
    ``divergence.loss``). Some say which section's field by their prefix (``--eval-*`` are ``task_eval``'s) or
    follow DeepSpeed's spelling."""
    from dataclasses import fields

    from opsd_rollout.cli.train import FLAGS
    from opsd_rollout.train import TrainConfig
    from opsd_rollout.train.sections import FLAT, SECTIONS
    from opsd_rollout.train.teacher_spec import FLAGS as TEACHER_FLAGS
    from opsd_rollout.train.teacher_spec import OPTIONS, TeacherSpec

    named_otherwise = {"samples_per_prompt": "sampling.n_samples_per_prompt", "teacher_cache": "teacher_cache.mode",
                       "teacher_top_k": "teacher_cache.top_k", "eval_data": "task_eval.data",
                       "eval_scorer": "task_eval.scorer", "eval_samples": "task_eval.samples",
                       "eval_max_new_tokens": "task_eval.max_new_tokens", "lora_rank": "lora.rank",
                       "lora_alpha": "lora.alpha", "lora_targets": "lora.targets", "merge_lora": "lora.merge"}
    top = {f.name for f in fields(TrainConfig)} - set(SECTIONS)
    for flag, dest, _kwargs in FLAGS:
        assert dest == flag[2:].replace("-", "_"), flag
        if dest in top:
            continue
        if dest in TEACHER_FLAGS:  # the teachers' flags: a TeacherSpec's field each (OPTIONS) or the sources
            assert dest in ("teacher", "teacher_url") or OPTIONS[dest][0] in {f.name for f in fields(TeacherSpec)}
            continue
        section, leaf = FLAT[dest].split(".")
        assert leaf in {f.name for f in fields(SECTIONS[section])}, flag
        assert leaf == dest or named_otherwise[dest] == FLAT[dest], flag


@pytest.mark.parametrize("argv,prefix", [(["bench", "--resume", "r.json"], "--resume"),
                                         (["step", "--loss", "jsd"], "--loss")])
def test_a_flag_is_taken_only_as_spelled_in_full(argv, prefix, capsys):
    """A unique prefix of a flag (``--resume`` of ``--resume-results``) is no spelling of it."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and f"unrecognized arguments: {prefix}" in capsys.readouterr().err


def test_config_files_take_the_flags_names(tmp_path, capsys):
    from opsd_rollout.bench.configfile import read_config_file, split_config
    from kernel_bench.scenario import KernelsScenario
    from opsd_rollout.bench.scenarios import RolloutScenario, StepScenario

    path = tmp_path / "bench.toml"
    path.write_text('prompt-kind = "variable"\n')
    assert split_config(read_config_file(path), RolloutScenario) == ({}, {"prompts": "variable"})
    path.write_text('student = "llama-tiny"\nteacher_cache_budget = "8GiB"\nprompt_kind = "variable"\n')
    assert split_config(read_config_file(path), StepScenario)[1] == {
        "model": "llama-tiny", "teacher_cache_budget_bytes": "8GiB", "prompts": "variable"}
    path.write_text("top_ks = [5, 50]\ntop-ps = 0.9\n")
    assert split_config(read_config_file(path), KernelsScenario)[0] == {"top_ks": [5, 50], "top_ps": [0.9]}
    assert capsys.readouterr().err == ""


def test_every_setting_flag_is_a_config_key_by_its_name():
    """``--config`` files take the flags' names: each setting a flag sets, a key of that name sets too."""
    from opsd_rollout.bench.configfile import split_config
    from opsd_rollout.bench.scenarios import SCENARIOS

    flags = visible_flags()
    for kind, scenario in SCENARIOS.items():
        command = "bench" if kind == "rollout" else kind
        axes = {axis.name for axis in scenario.axes}
        for option, action in flags[command].items():
            key = option[2:].replace("-", "_")
            if action.dest in axes or action.dest not in scenario.settings_type.__dataclass_fields__:
                continue  # an axis (keyed by its name), or not a setting (output, ranks, --config)
            assert split_config({key: "x"}, scenario) == ({}, {action.dest: "x"}), (command, option)
