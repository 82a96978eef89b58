"""``opsd-rollout train --eval-data FILE --eval-scorer NAME --eval-samples K``: the task figures at every evaluation,
the teacher's once in the step-0 record (a teacher whose completions are known, so its figures are exact), the keys
registered and sent to DeepSpeed's monitors under their names, eval.png; a served teacher is not scored (a line
says so); bad input refused before any model loads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from opsd_rollout.cli import main
from opsd_rollout.metrics import training_metric
from opsd_rollout.train import TrainConfig, train
from test_task_eval import known_checkpoint, problems_file  # noqa: F401 (a fixture)
from test_train import write_prompts

TINY = dict(student="llama-tiny", prompts_per_micro_batch=2, max_new_tokens=6, eval_prompts=2, eval_every=2,
            progress=False, lr=1e-3)


def test_task_figures_at_each_evaluation_and_the_teachers_at_step_0(tmp_path, known_checkpoint):
    pytest.importorskip("matplotlib")
    from opsd_rollout.train.setup import deepspeed_config_of

    config = dict(TINY, teacher=known_checkpoint, prompts=str(write_prompts(tmp_path / "p.jsonl")),
                  eval_data=str(problems_file(tmp_path)), eval_scorer="last-number", eval_samples=4)
    ds = deepspeed_config_of(TrainConfig.from_flat(dict(config, output_dir="", steps=1)))
    ds["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"}
    result = train(TrainConfig.from_flat(dict(config, output_dir=str(tmp_path / "run"), steps=2, deepspeed=ds)))
    first, second, third = result.records
    assert first["teacher_eval_accuracy"] == pytest.approx(1 / 3) and first["teacher_eval_unextractable"] == 1
    assert first["teacher_eval_pass@1"] == pytest.approx(1 / 3) and first["teacher_eval_pass@4"] == pytest.approx(1 / 3)
    for record in (first, third):
        assert 0 <= record["eval_accuracy"] <= 1 and 0 <= record["eval_unextractable"] <= 3
        assert 0 <= record["eval_pass@1"] <= record["eval_pass@4"] <= 1
        assert 0 < record["time/task_evaluation_ms"] < record["time/evaluation_ms"]
    assert not any(key.startswith(("eval_", "teacher_eval_")) for key in second)  # not an evaluation step
    assert not any(key.startswith("teacher_eval_") for key in third)  # the teacher once
    assert all(training_metric(key) is not None for r in result.records for key in r)  # every key registered
    sent = {path.stem for path in (tmp_path / "csv" / "run").glob("*.csv")}  # DeepSpeed names a tag's file by it
    assert {"eval_accuracy", "eval_pass@1", "eval_pass@4", "eval_unextractable", "eval_teacher_accuracy",
            "eval_teacher_pass@4"} <= sent
    accuracy = (tmp_path / "csv" / "run" / "eval_accuracy.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in accuracy[1:]] == ["0", "2"]
    assert result.plot is not None and result.plot.is_file()
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["task_eval"] == {"data": config["eval_data"], "scorer": "last-number", "samples": 4,
                                  "max_new_tokens": None}


def test_a_served_teacher_is_not_scored_and_a_line_says_so(tmp_path, caplog):
    from opsd_rollout.models import load_model
    from opsd_rollout.serve import ServeConfig, TeacherServer

    teacher, tokenizer = load_model("llama-tiny")
    server = TeacherServer(ServeConfig(model="llama-tiny", port=0), model=teacher, tokenizer=tokenizer).start()
    try:
        with caplog.at_level(logging.WARNING):
            result = train(TrainConfig.from_flat(dict(
                TINY, steps=1, output_dir=str(tmp_path / "run"), teacher_url=server.url, loss="sampled_reverse_kl",
                eval_data=str(problems_file(tmp_path)), eval_scorer="last-number")))
    finally:
        server.stop()
    assert "eval_accuracy" in result.records[0] and "eval_accuracy" in result.records[-1]
    assert not any(key.startswith("teacher_eval_") for r in result.records for key in r)
    assert "the served teacher is not scored on --eval-data" in caplog.text


@pytest.mark.parametrize("argv, message", [
    (["--eval-data", "{missing}", "--eval-scorer", "gsm8k"], "--eval-data '{missing}' does not exist"),
    (["--eval-data", "{file}", "--eval-scorer", "math"], "--eval-scorer: unknown scorer 'math'"),
    (["--eval-data", "{file}", "--eval-scorer", "gsm8k", "--eval-samples", "0"], "--eval-samples must be an int >= 1"),
    (["--eval-data", "{no_answer}", "--eval-scorer", "gsm8k"], "line 2: no 'answer'"),
    (["--eval-data", "{file}", "--eval-scorer", "gsm8k"], "no 'answer' holds one the gsm8k scorer can read"),
    (["--eval-data", "{file}", "--eval-scorer", "exact", "--eval-samples", "4", "--temperature", "0"],
     "--eval-samples 4 samples at the run's temperature 0.0, which is greedy"),
    (["--eval-scorer", "exact"], "--eval-scorer needs --eval-data"),
])
def test_bad_task_eval_input_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    import opsd_rollout.train.setup as setup

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(setup, "load_model", no_model)
    paths = {"missing": str(tmp_path / "none.jsonl"), "file": str(tmp_path / "words.jsonl"),
             "no_answer": str(tmp_path / "no_answer.jsonl")}
    Path(paths["file"]).write_text('{"prompt": "a", "answer": "seventy"}\n')
    Path(paths["no_answer"]).write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    argv = [arg.format(**paths) for arg in argv]
    assert main(["train", "--output-dir", str(tmp_path / "out"), "--student", "llama-tiny", "--teacher",
                 "qwen2-tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opsd-rollout: error:") and message.format(**paths) in err and len(err.splitlines()) == 1


def test_a_k_dependent_key_is_its_at_k_entry_under_its_own_names():
    from opsd_rollout.train.report import monitor_events

    assert training_metric("eval_pass@16").monitor == "eval/pass@16"
    assert training_metric("teacher_eval_pass@16").label == "teacher pass@16"
    assert training_metric("eval_pass@1").meaning != training_metric("eval_pass@2").meaning  # pass@1 is its own
    assert training_metric("eval_pass@x") is None and training_metric("loss@3") is None
    assert monitor_events({"step": 0, "eval_pass@16": 0.5}) == [("eval/pass@16", 0.5, 0)]


@pytest.mark.slow
def test_two_zero3_ranks_score_every_problem_in_lockstep(tmp_path, known_checkpoint):
    """Under torchrun, student and teacher partitioned (ZeRO-3), 5 problems over 2 ranks at 2 prompts a rollout:
    rank 0 takes 3 problems (2 rollouts), rank 1 2 (1, and one more to keep step); no hang, and the figures are over
    all 5 problems (rank 0's alone would give the teacher 1/3)."""
    import sys

    from conftest import clean_env, run_named
    from opsd_rollout.distributed import free_port
    from test_task_eval import PROBLEMS

    rows = [{"prompt": p, "answer": a} for p, a in PROBLEMS + PROBLEMS[:2]]  # right, none, wrong, right, none
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "opsd_rollout", "train", "--student", "llama-tiny",
               "--teacher", known_checkpoint, "--steps", "1", "--prompts-per-micro-batch", "2", "--max-new-tokens", "6",
               "--eval-every", "1", "--eval-prompts", "4", "--zero-stage", "3", "--teacher-zero-stage", "3",
               "--temperature", "1.0", "--eval-data", str(data), "--eval-scorer", "last-number", "--eval-samples",
               "2", "--output-dir", str(out), "--quiet"]
    result = run_named("train with task evaluation on 2 ZeRO-3 ranks (about 20 s on 2 quiet cores)", command,
                       env={**clean_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    first, last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first["teacher_eval_accuracy"] == pytest.approx(2 / 5) and first["teacher_eval_unextractable"] == 2
    assert first["teacher_eval_pass@1"] == pytest.approx(2 / 5) and first["teacher_eval_pass@2"] == pytest.approx(2 / 5)
    assert all(0 <= r["eval_accuracy"] <= 1 and "eval_pass@2" in r for r in (first, last))
    assert result.stdout.count("task accuracy:") == 1  # rank 0 speaks


def test_the_built_in_run_checks_the_eval_file_before_its_teacher_trains(tmp_path, monkeypatch, capsys):
    import opsd_rollout.train.default as default

    monkeypatch.setattr(default, "trained_teacher", lambda *args, **kwargs: pytest.fail("the teacher trained first"))
    assert main(["train", "--output-dir", str(tmp_path / "out"), "--eval-data", str(tmp_path / "none.jsonl"),
                 "--eval-scorer", "gsm8k"]) == 2
    assert "--eval-data" in capsys.readouterr().err


def test_the_task_eval_section_reads_back_from_train_config_json(tmp_path):
    from opsd_rollout.train import load_train_config

    config = TrainConfig.from_flat(dict(TINY, teacher="qwen2-tiny", output_dir=str(tmp_path), eval_data="e.jsonl",
                                        eval_scorer="boxed", eval_samples=8, eval_max_new_tokens=512))
    (tmp_path / "train_config.json").write_text(json.dumps(config.to_dict()))
    assert load_train_config(tmp_path / "train_config.json") == config
    assert config.task_eval.new_tokens(6) == 512 and config.sampling.max_new_tokens == 6
