"""scripts/task_comparison.py's report: accuracy at equal steps and at equal wall time, the step at which half the
teacher's accuracy is reached, supervised KD's generation counted in its wall time (made-up runs, nothing trained);
the document it writes, and the one committed, are what its schema (scripts/task_comparison.schema.json) says."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "scripts" / "task_comparison.schema.json").read_text())


def _script():
    """The script, imported as a module (pytest's pythonpath has scripts/)."""
    import task_comparison

    return task_comparison


def _run(path: Path, points: list[tuple[int, float, float]], teacher: float | None = None) -> None:
    path.mkdir(parents=True)
    records = []
    for step, accuracy, seconds in points:
        record = {"step": step, "eval_accuracy": accuracy, "eval_unextractable": 0}
        if step:
            record["time/steps_s"] = seconds
        elif teacher is not None:
            record["teacher_eval_accuracy"] = teacher
        records.append(record)
        records.append({"step": step + 1, "loss": 1.0})  # a step without an evaluation is not a point
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    (path / "train_config.json").write_text("{}")


def test_the_report_reads_equal_steps_equal_time_and_half_the_teacher(tmp_path):
    tc = _script()
    runs = tmp_path / "runs"
    _run(runs / "forward_kl", [(0, 0.0, 0), (200, 0.1, 100.0), (400, 0.6, 200.0)], teacher=0.9)
    _run(runs / "supervised_kd", [(0, 0.0, 0), (200, 0.5, 20.0), (400, 0.7, 40.0)])
    (runs / "teacher_samples.json").write_text(json.dumps({"seconds": 150.0}))
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"prompt": "1+1\\n", "answer": "2"}\n' * 3)
    result = tc.report(runs, ["forward_kl", "supervised_kd"], {}, tc.student_settings(400), 1, 2,
                       tmp_path / "teacher", eval_file)
    assert result["teacher_eval_accuracy"] == 0.9 and result["eval_problems"] == 3
    kd, fkl = result["arms"]["supervised_kd"], result["arms"]["forward_kl"]
    assert [p["wall_seconds"] for p in kd["points"]] == [150.0, 170.0, 190.0]  # the generation counted
    assert result["equal_steps"] == 400 and result["equal_wall_seconds"] == 190.0
    assert fkl["summary"]["accuracy_at_equal_time"] == 0.1 and fkl["summary"]["step_at_equal_time"] == 200
    assert kd["summary"]["accuracy_at_equal_time"] == 0.7
    assert fkl["summary"]["half_teacher_step"] == 400 and kd["summary"]["half_teacher_step"] == 200
    assert kd["summary"]["half_teacher_wall_seconds"] == 170.0
    assert fkl["summary"]["accuracy_at_each_arms_end"] == {"forward_kl": 0.6, "supervised_kd": 0.1}
    jsonschema.validate(result, SCHEMA)
    assert result["kind"] == "task_comparison" and result["version"] == 1
    tc.plot(result, tmp_path / "out" / "comparison.png")
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 0


def test_supervised_kds_samples_train_the_teachers_tokens_and_its_eos_where_it_ended(tmp_path):
    """A teacher's sample that ended trains its tokens and that EOS, once; one cut at max_new_tokens its tokens
    alone (a continuation): exactly the tokens the teacher sampled, whichever way it stopped."""
    import torch

    from opsd_rollout.models import EOS_ID, byte_tokenizer
    from opsd_rollout.opsd.targets import response_targets
    from opsd_rollout.train import read_examples
    from opsd_rollout.train.data import Encoder

    tc, tokenizer = _script(), byte_tokenizer()
    samples = ["7+8=15, 5\n#### 15</s>", "7+8=15, 5\n#### 1"]  # as teacher_responses returns them: ended, cut
    path = tmp_path / "teacher_samples.jsonl"
    path.write_text("".join(json.dumps(tc.sample_record("7+8?\n", s, tokenizer.eos_token)) + "\n" for s in samples))
    batch = Encoder(tokenizer, max_prompt_tokens=64, max_reference_tokens=80).with_references(
        read_examples(path, tokenizer), torch.device("cpu"))
    targets = response_targets(batch)
    trained = [labels[mask].tolist() for labels, mask in zip(targets.labels, targets.mask)]
    assert trained == [tokenizer(s, add_special_tokens=False)["input_ids"] for s in samples]
    assert [row.count(EOS_ID) for row in trained] == [1, 0]


def test_the_committed_comparison_is_a_document_of_its_schema():
    document = json.loads((ROOT / "benchmarks" / "task" / "comparison.json").read_text())
    jsonschema.validate(document, SCHEMA)
    assert set(document["arms"]) <= set(_script().ARMS)


def test_an_arm_says_where_its_teacher_comes_from():
    """What run_arm and the report read of an arm (issue 49 adds arms): the teacher, its samples, its flags."""
    arms = _script().ARMS
    assert not arms["sft"].teacher and arms["supervised_kd"].teacher_samples
    assert [name for name, arm in arms.items() if arm.teacher_samples] == ["supervised_kd", "gkd_mix"]
    assert arms["gkd_mix"].recipe and arms["gkd_mix"].flags == ("--lmbda", "0.5", "--loss", "jsd")  # GKD's mix
    assert all("--loss" in arm.flags or "--objective" in arm.flags for arm in arms.values())


def test_the_recipes_report_reads_each_seeds_arms_from_its_warm_start(tmp_path):
    """Version 2: each seed's warm start and its arms (every arm's step 0 the warm start's accuracy), a table of every
    arm's accuracy at equal steps and equal time on every seed, the document of its schema, and its plot."""
    tc = _script()
    runs = tmp_path / "runs"
    for seed, (warm, fast, slow) in {0: (0.3, 0.8, 0.6), 1: (0.25, 0.7, 0.65)}.items():
        _run(runs / f"seed{seed}" / "warm_start", [(0, 0.0, 0), (300, warm, 50.0)])
        _run(runs / f"seed{seed}" / "reverse_kl_topk", [(0, warm, 0), (100, fast, 120.0)], teacher=0.95)
        _run(runs / f"seed{seed}" / "sft", [(0, warm, 0), (100, slow, 20.0)])
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"prompt": "1+1\\n", "answer": "2"}\n')
    recipe = tc.Recipe("arithmetic", labelled=300, warm_steps=300)
    result = tc.recipe_report(runs, ["reverse_kl_topk", "sft"], [0, 1], tc.student_settings(100), 1, 2,
                              tmp_path / "teacher", eval_file, recipe)
    jsonschema.validate(result, SCHEMA)
    assert result["version"] == 2 and result["teacher_eval_accuracy"] == 0.95
    assert result["warm_starts"]["1"] == {"accuracy": 0.25, "train_seconds": 50.0, "steps": 300}
    assert result["table"]["reverse_kl_topk"]["0"] == {"at_equal_steps": 0.8, "at_equal_time": 0.3, "final": 0.8}
    assert result["table"]["sft"]["1"]["at_equal_time"] == 0.65  # SFT's 100 steps end first: equal time is its end
    tc.recipe_plot(result, tmp_path / "recipe.png")
    assert (tmp_path / "recipe.png").stat().st_size > 0


def test_the_recipes_arms_start_from_the_warm_start_on_the_split_task(tmp_path):
    tc = _script()
    recipe = tc.Recipe("arithmetic-5d", labelled=300, warm_steps=300)
    settings = dict(student="llama-tiny", steps=100, prompts_per_micro_batch=32, lr=3e-4, eval_every=50,
                    eval_prompts=64, max_new_tokens=120, seed=1)
    flags = {name: tc.arm_flags(name, settings, recipe, Path("T"), Path("S.jsonl"), Path("E.jsonl"), Path("W/model"))
             for name in ("sft", "supervised_kd", "self_distillation", "reverse_kl_topk")}
    for name, arm in flags.items():
        assert arm[arm.index("--student") + 1] == "W/model", name
    assert flags["sft"][:4] == ["--task", "arithmetic-5d", "--objective", "sft"] and "--task-labelled" in flags["sft"]
    assert "--teacher" not in flags["sft"]
    assert flags["supervised_kd"][flags["supervised_kd"].index("--prompts") + 1] == "S.jsonl"
    assert flags["self_distillation"][-2:] == ["--teacher", "self"]
    assert flags["reverse_kl_topk"][-2:] == ["--teacher", "T"] and "300" in flags["reverse_kl_topk"]


def test_the_warm_start_file_holds_each_labelled_problem_twice_and_the_held_out_lines(tmp_path):
    from opsd_rollout.train.tasks import TASKS
    from opsd_rollout.train.teacher_spec import DEFAULT_CONTEXT, fill

    tc = _script()
    path = tmp_path / "warm.jsonl"
    tc.write_warm_start_file(path, "arithmetic", 9)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    train, held_out = TASKS["arithmetic"].problems()
    trained = [line for i, line in enumerate(lines) if i % 10 != 9]
    assert len(trained) == 18 and [line["prompt"] for line in lines[9::10]] == [held_out[0].prompt]
    assert trained[9] == {"prompt": fill(DEFAULT_CONTEXT, prompt=train[0].prompt, reference=train[0].reference),
                          "reference": train[0].reference}
