"""``train``'s bad input is one line before any work, and before torch, transformers or DeepSpeed load: each flag's
value, the files (prompts line by line, the DeepSpeed config, a --resume directory), the models' names and
vocabularies, the LoRA flags. Checked by what a run imports before it refuses (never by its time), in this process
with torch and its kin hidden and any import of them an error; the layers a LoRA target must match are checked once
the student's config is loaded, before its weights."""

from __future__ import annotations

import importlib
import logging
import json
import sys
from pathlib import Path

import pytest

from opsd_rollout.cli import main

HEAVY = ("torch", "transformers", "deepspeed", "peft")


class _Refuse:
    """A meta-path finder that fails any import of ``HEAVY`` (which must not be in ``sys.modules`` to be seen)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise AssertionError(f"imported {name} before refusing bad input")
        return None


@pytest.fixture
def light(monkeypatch):
    """A fresh ``opsd_rollout`` with torch, transformers, DeepSpeed and PEFT hidden: importing any is an error.
    ``sys.modules`` is put back whole afterwards (this process's torch and package untouched), and DeepSpeed's
    logger's filters (the fresh package's CLI installs its own ``CpuFallbackFilter``, of another class object)."""
    saved = dict(sys.modules)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    filters = list(deepspeed_logger.filters)
    for name in list(sys.modules):
        if name.split(".")[0] in (*HEAVY, "opsd_rollout"):
            del sys.modules[name]
    finder = _Refuse()
    sys.meta_path.insert(0, finder)
    try:
        yield importlib.import_module("opsd_rollout.cli")
    finally:
        sys.meta_path.remove(finder)
        sys.modules.clear()
        sys.modules.update(saved)
        deepspeed_logger.filters[:] = filters


def write(path: Path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(train's arguments, the line it must print) for each kind of bad input that needs no model."""
    teacher = ["--teacher", "llama-mini"]
    (tmp / "empty").mkdir(exist_ok=True)
    return [
        (["--steps", "0"], "--steps must be an int >= 1; got 0"),
        (["--lr", "-1", *teacher], "--lr must be a number > 0; got -1.0"),
        (["--lmbda", "1.5", *teacher], "--lmbda must be in [0, 1]; got 1.5"),
        (["--top-p", "0", *teacher], "--top-p must be in (0, 1]; got 0.0"),
        (["--lora-rank", "0", *teacher], "--lora-rank must be an int >= 1; got 0"),
        (["--lora-rank", "-3", *teacher], "--lora-rank must be an int >= 1; got -3"),
        (["--lora-alpha", "0", "--lora-rank", "4", *teacher], "--lora-alpha must be a number > 0; got 0.0"),
        (["--lora-targets", "q_proj", *teacher], "--lora-targets shapes LoRA adapters, and there are none without "
                                                 "--lora-rank"),
        (["--merge-lora", *teacher], "--merge-lora shapes LoRA adapters"),
        (["--teacher", "qwen2-0.5b"], "student 'llama-tiny' has a vocabulary of 259 tokens and teacher 'qwen2-0.5b' "
                                      "one of 151,936: distillation needs the same vocabulary"),
        (["--student", "org/model", *teacher], "model 'org/model' is neither a built-in preset"),
        (["--prompts", write(tmp / "p.jsonl", [{"prompt": "x"}])], "teacher is needed to distil"),
        (["--prompts", str(tmp / "missing.jsonl"), *teacher], "does not exist (or is not a file)"),
        (["--task", "arithmetic", "--prompts", write(tmp / "p.jsonl", [{"prompt": "x"}]), *teacher],
         "--task arithmetic brings its own examples and --prompts"),
        (["--prompts", write(tmp / "bad.jsonl", [{"prompt": "a"}, "", '{"prompt": "x"']), *teacher],
         "bad.jsonl' line 3 is not JSON"),
        (["--prompts", write(tmp / "sys.jsonl", [{"prompt": "a"}, {"messages": [
            {"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}]), *teacher],
         "sys.jsonl' line 2: the last message is the 'system' turn"),
        (["--deepspeed", write(tmp / "ds.json", ["[1, 2]"]), *teacher], "ds.json' must hold a JSON object"),
        (["--resume", str(tmp / "empty"), *teacher], "holds no checkpoint"),
        (["--deepspeed", write(tmp / "bf16.json", [{"bf16": {"enabled": True}}]), "--dtype", "fp32", *teacher],
         "--dtype fp32 and " + str(tmp / "bf16.json") + " disagree: its bf16 on"),
        (["--save-best", "loss", *teacher], "--save-best 'loss' is not an evaluation figure with a direction"),
        (["--save-best", "eval_accuracy", *teacher], "a task evaluation's figure, and the run has none"),
        (["--save-total-limit", "0", *teacher], "--save-total-limit must be an int >= 1; got 0"),
    ]


def test_bad_input_is_refused_in_one_line_before_torch_loads(tmp_path, monkeypatch, capsys, light):
    """Every refusal here runs in a fresh package with torch, transformers, DeepSpeed and PEFT hidden: had the
    command imported one of them before refusing, the import would have failed the test."""
    monkeypatch.setenv("OPSD_ROLLOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # as set: main samples no CPU use and changes nothing
    for argv, message in bad_inputs(tmp_path):
        code = light.main(["train", "--output-dir", str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("opsd-rollout: error: ") and message in lines[0], (argv, err)
        assert not (tmp_path / "run").exists()  # nothing written


def test_an_output_directory_that_holds_a_run_or_is_a_file_is_refused_before_torch_loads(tmp_path, capsys, light):
    done = tmp_path / "done"
    (done / "checkpoints").mkdir(parents=True)
    (done / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "a_file").write_text("")
    for argv, message in [
        (["--output-dir", str(done)], f"--output-dir {str(done)!r} holds a run (metrics.jsonl, checkpoints): continue "
                                      f"it with --resume {done}, or start over with --overwrite"),
        (["--output-dir", str(tmp_path / "a_file")], "is a file: name a directory"),
        (["--output-dir", str(tmp_path / "a_file" / "run")], f"lies under {str(tmp_path / 'a_file')!r}, a file"),
        ([], "--output-dir DIR is needed: where the run writes (--resume DIR alone continues that run in DIR)"),
    ]:
        assert light.main(["train", "--teacher", "llama-mini", *argv]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("opsd-rollout: error: ")
        assert message in lines[0], (argv, lines)


def test_the_flag_checks_refuse_what_train_config_refuses():
    """Each value the command line refuses before torch loads, ``TrainConfig`` refuses too (for the library's
    callers), and each it accepts, ``TrainConfig`` accepts: the light checks cannot drift from the config's."""
    from opsd_rollout.train import TrainConfig
    from opsd_rollout.train.preflight import DEFAULT_STUDENT, RULES, preflight

    assert TrainConfig(output_dir="o", teachers=["t"]).student == DEFAULT_STUDENT
    probes = {"int": [0, -1, 1, 2], "float": [-1.0, 0.0, 0.5, 1.0, 1.5, float("nan"), float("inf")]}
    for name in RULES:
        kind = "int" if name in ("steps", "prompts_per_micro_batch", "samples_per_prompt", "max_new_tokens",
                                 "max_prompt_tokens", "eval_every", "eval_prompts", "save_every", "teacher_top_k",
                                 "gradient_accumulation_steps", "lora_rank", "top_k", "save_total_limit",
                                 "warmup_sft_steps", "task_labelled", "task_unlabelled", "max_skipped_steps") else "float"
        for value in probes[kind]:
            values = {"teacher": "qwen2-tiny", name: value, **({"lora_rank": 4} if name == "lora_alpha" else {}),
                      **({"warmup_sft_steps": 1} if name == "warmup_sft_lr" else {}),
                      **({"task": "arithmetic", "max_new_tokens": 100} if name.startswith("task_") else {}),
                      **({"task_labelled": 10} if name == "task_unlabelled" else {}),
                      **({"teacher_url": "http://127.0.0.1:1"} if name == "teacher_timeout" else {})}
            light_ok = _accepts(lambda: preflight(values))
            config_ok = _accepts(lambda: TrainConfig.from_flat({"output_dir": "o", **values}))
            assert light_ok == config_ok, (name, value, light_ok, config_ok)


def _accepts(check) -> bool:
    try:
        check()
    except ValueError:
        return False
    return True


def test_a_lora_target_that_matches_no_layer_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    from opsd_rollout.train import TrainConfig, setup, train

    monkeypatch.setattr(setup, "load_model", lambda *a, **k: pytest.fail("loaded the weights"))
    config = TrainConfig.from_flat(dict(output_dir=str(tmp_path), teacher="qwen2-tiny", lora_rank=4,
                                        lora_targets="q_proj,qproj,v_proj", progress=False))
    with pytest.raises(ValueError, match=r"--lora-targets 'qproj' matches no layer of the student 'llama-tiny'; "
                                         r"its layers LoRA can wrap: down_proj, embed_tokens, gate_proj, k_proj, "
                                         r"lm_head, o_proj, q_proj, up_proj, v_proj \(or all-linear\)"):
        train(config)
    gpt2 = TrainConfig.from_flat(dict(output_dir=str(tmp_path), student="gpt2-tiny", teacher="qwen2-tiny",
                                      lora_rank=4, lora_targets="q_proj", progress=False))
    with pytest.raises(ValueError, match="'q_proj' matches no layer of the student 'gpt2-tiny'; .*c_attn"):
        train(gpt2)  # GPT-2's layers are transformers' Conv1D, which LoRA wraps too


def test_a_served_or_builtin_run_skips_the_teacher_checks_it_cannot_make(tmp_path):
    from opsd_rollout.train.preflight import preflight

    preflight({"teacher_url": "http://127.0.0.1:1", "teacher": "whatever-the-server-serves"})
    preflight({"steps": 3}, builtin=True)  # the built-in run's teacher is its own
