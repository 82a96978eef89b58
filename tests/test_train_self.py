"""``train --teacher self``: the student distils from itself, shown the reference in its teacher's prompt, everywhere
a teacher works (every loss and cache, ZeRO 0-3, LoRA, accumulation, evaluation, resume, beside other teachers,
served), and what makes no sense is refused before any work. (tests/test_self_distillation.py checks the step.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opsd_rollout.cli import main
from opsd_rollout.train import TeacherSpec, TrainConfig, train
from opsd_rollout.train.teacher_spec import DEFAULT_CONTEXT

TINY = dict(student="llama-tiny", prompts_per_micro_batch=2, max_new_tokens=8, eval_prompts=2, eval_every=2,
            progress=False, lr=1e-2, temperature=1.0)


def prompts(path: Path, count: int = 12, *, chat: bool = False, teachers: list[str] | None = None) -> Path:
    lines = []
    for i in range(count):
        line = ({"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+{i}?"}]}
                if chat else {"prompt": f"What is {i} plus {i}?"})
        line["reference"] = f"{2 * i}"
        if teachers:
            line["teacher"] = teachers[i % len(teachers)]
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    return path


def run(tmp_path, name="run", **changes):
    data = changes.pop("data", None) or prompts(tmp_path / "p.jsonl")
    return train(TrainConfig.from_flat({**TINY, "teacher": "self", "prompts": str(data),
                                        "output_dir": str(tmp_path / name), **changes}))


@pytest.mark.parametrize("loss,cache", [("jsd", "full"), ("reverse_kl", "topk"), ("forward_kl", "topk"),
                                        ("sampled_reverse_kl", "sampled")])
def test_every_loss_and_cache_distils_the_student_from_itself(tmp_path, loss, cache):
    result = run(tmp_path, steps=2, loss=loss, teacher_cache=cache, teacher_top_k=8)
    steps = [r for r in result.records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert steps[0]["teacher"] == "self (initial)" and steps[0]["teacher_context"] == DEFAULT_CONTEXT
    assert "eval_reverse_kl" in result.records[0]  # against the self-teacher with its context


@pytest.mark.parametrize("weights", ["initial", "live"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_self_teacher_trains_at_every_zero_stage(tmp_path, stage, weights):
    result = run(tmp_path, steps=2, zero_stage=stage, self_teacher=weights, gradient_accumulation_steps=2)
    steps = [r for r in result.records if "loss" in r]
    assert len(steps) == 2 and steps[-1]["teacher"] == f"self ({weights})" and steps[-1]["micro_batches"] == 2
    assert all(r["loss"] > 0 for r in steps)  # the context makes the teacher another distribution


def test_the_initial_teacher_stays_the_starting_weights_and_live_follows_the_student(tmp_path):
    """Over the first steps the initial self-teacher is the untrained student, so the held-out KL to it grows as the
    student moves away; the live one moves with the student."""
    from opsd_rollout.train.loop import _Run
    from opsd_rollout.train.setup import load_models, split_examples

    for weights in ("initial", "live"):
        config = TrainConfig.from_flat({**TINY, "teacher": "self", "self_teacher": weights, "steps": 2,
                                        "prompts": str(prompts(tmp_path / "p.jsonl")),
                                        "output_dir": str(tmp_path / weights)})
        models = load_models(config)
        start = {k: v.clone() for k, v in models.student.state_dict().items()}
        state = _Run(config, models, *split_examples(config, None))
        state.run()
        teacher = state.teacher.module
        moved = any(not torch.equal(start[k], v) for k, v in state.engine.module.state_dict().items())
        assert moved
        same_as_start = all(torch.equal(start[k], v) for k, v in teacher.state_dict().items())
        assert same_as_start == (weights == "initial")


def test_a_lora_student_teaches_itself_with_its_adapters_off_and_no_copy(tmp_path):
    pytest.importorskip("peft")
    result = run(tmp_path, steps=2, lora_rank=4)
    steps = [r for r in result.records if "loss" in r]
    assert len(steps) == 2 and steps[0]["teacher"] == "self (initial)"
    assert (tmp_path / "run" / "model" / "adapter_config.json").exists()


def test_resume_continues_exactly(tmp_path):
    """4 steps equal 2 steps and a resume to 4: the initial teacher is the starting weights, not the resumed ones."""
    data = prompts(tmp_path / "p.jsonl")
    whole = run(tmp_path, "whole", steps=4, data=data)
    run(tmp_path, "half", steps=2, data=data)
    resumed = run(tmp_path, "half", steps=4, data=data, resume=str(tmp_path / "half"))
    losses = [(r["step"], r["loss"]) for r in whole.records if "loss" in r]
    assert [(r["step"], r["loss"]) for r in resumed.records if "loss" in r] == losses


def test_the_self_teacher_beside_another_each_example_to_its_own(tmp_path):
    data = prompts(tmp_path / "p.jsonl", 20, teachers=["s", "q", "q"])  # held out: lines 10 (s) and 20 (q)
    result = train(TrainConfig.from_flat({**TINY, "teacher": ["s=self", "q=qwen2-tiny"], "prompts": str(data),
                                          "prompts_per_micro_batch": 4, "steps": 1,
                                          "output_dir": str(tmp_path / "run")}))
    first = result.records[1]
    assert {"loss/s", "loss/q"} <= set(first) and first["teacher"] == "s=self (initial), q=qwen2-tiny"
    assert first["teacher_context"] == f"s={DEFAULT_CONTEXT}"  # the other teacher sees the student's prompt
    assert {"eval_reverse_kl/s", "eval_reverse_kl/q"} <= set(result.records[0])


def test_chat_examples_show_the_reference_in_the_last_user_turn(tmp_path, tokenizer):
    from opsd_rollout.train.data import read_examples

    data = prompts(tmp_path / "p.jsonl", 2, chat=True)
    template = "{prompt} (the answer: {reference})"
    examples = read_examples(data, tokenizer, lambda _name: template)
    assert examples[1].teacher_prompt.replace(" (the answer: 2)", "") == examples[1].prompt
    assert "system: Add." in examples[1].teacher_prompt  # the rest of the conversation is the student's
    result = run(tmp_path, steps=1, data=data, teacher_context=template)
    assert result.records[1]["teacher_context"] == template


def test_a_served_self_teacher_scores_as_the_one_in_process(tmp_path):
    """``serve-teacher`` serving the student's starting weights, each request carrying the teacher's prompt: the
    losses of the first step (before any update) equal the in-process initial self-teacher's."""
    from opsd_rollout.models import load_model
    from opsd_rollout.serve import ServeConfig, TeacherServer

    model, tokenizer = load_model("llama-tiny")
    server = TeacherServer(ServeConfig(model="llama-tiny", port=0), model=model, tokenizer=tokenizer).start()
    url = server.url
    try:
        common = dict(steps=2, teacher_cache="topk", teacher_top_k=16, top_k_rest="tail")
        here = run(tmp_path, "here", **common)
        there = run(tmp_path, "there", teacher_url=url, **common)
    finally:
        server.stop()
    assert there.records[1]["loss"] == pytest.approx(here.records[1]["loss"], rel=1e-4)
    assert there.records[1]["teacher"] == f"self (initial, {url})"


@pytest.mark.parametrize("argv,message", [
    (["--teacher", "self", "--objective", "sft"], "--teacher self distils the student from itself"),
    (["--teacher", "llama-tiny", "--self-teacher", "live"], "--self-teacher: an option of the student as its own"),
    (["--teacher", "self", "--teacher-context", "{prompt} only"], "must show the teacher the reference"),
    (["--teacher", "self", "--teacher-context", "{prompt}{reference}{hint}"], "unknown placeholder {hint}"),
    (["--teacher", "self", "--teacher-url", "http://127.0.0.1:9", "--self-teacher", "live"],
     "--self-teacher live is the student's weights as they train"),
    (["--teacher", "self", "--lmbda", "0.5", "--off-policy", "teacher"], "the self-teacher scores, it does not sample"),
    (["--teacher", "self", "NOREF"], "line 2: its teacher is shown the reference"),
])
def test_what_makes_no_sense_is_refused_in_one_line_before_torch(tmp_path, capsys, argv, message):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "reference": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    argv = [a for a in argv if a != "NOREF"] + (["--prompts", str(data)] if "NOREF" in argv else [])
    code = main(["train", "--student", "llama-tiny", *argv, "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_the_library_refuses_a_self_teacher_with_sft_and_an_example_without_a_reference(tmp_path):
    with pytest.raises(ValueError, match="--teacher self distils the student from itself"):
        TrainConfig(output_dir="o", teachers=[TeacherSpec(source="self")], objective="sft")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "no reference here"}) + "\n")
    with pytest.raises(ValueError, match="line 1: its teacher is shown the reference"):
        train(TrainConfig.from_flat({**TINY, "teacher": "self", "prompts": str(data), "steps": 1,
                                     "output_dir": str(tmp_path / "run")}))


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["initial", "live"])
def test_two_zero3_ranks_distil_the_student_from_itself(tmp_path, weights):
    """Under torchrun at ZeRO-3: the initial teacher's copy partitioned as the student is, the live one the student's
    own partitions; the ranks stay in lockstep through rollouts, the self-teacher's caches (each rank's teacher
    prompts of other lengths) and evaluations."""
    import sys

    from conftest import clean_env, run_named
    from opsd_rollout.distributed import free_port

    out = tmp_path / "run"
    data = prompts(tmp_path / "p.jsonl", 24)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "opsd_rollout", "train", "--student", "llama-tiny",
               "--teacher", "self", "--self-teacher", weights, "--prompts", str(data), "--steps", "2",
               "--prompts-per-micro-batch", "2", "--max-new-tokens", "8", "--eval-every", "2", "--eval-prompts", "4",
               "--zero-stage", "3", "--temperature", "1.0", "--output-dir", str(out), "--quiet"]
    result = run_named(f"self-distillation ({weights}) on 2 ZeRO-3 ranks (about 15 s on 2 quiet cores)", command,
                       env={**clean_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["loss"] > 0 and r["teacher"] == f"self ({weights})" for r in records[1:])
    assert "eval_reverse_kl" in records[0]
