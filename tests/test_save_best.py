"""``--save-best METRIC``: ``best/`` holds the student of the best evaluation so far by METRIC (its direction the
registry's), with the step it came from; ``--save-total-limit N`` prunes the oldest checkpoints as transformers'
Trainer does, never the latest (DeepSpeed's ``latest`` names one that exists) nor the best's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opsd_rollout.cli import main
from opsd_rollout.train.best import Best, check_save_best
from opsd_rollout.train.checkpoint import prune_checkpoints
from test_train import write_prompts


def make_checkpoints(root: Path, steps: list[int], latest: int) -> Path:
    checkpoints = root / "checkpoints"
    for step in steps:
        (checkpoints / f"step{step}").mkdir(parents=True)
    (checkpoints / "step9.tmp").mkdir()  # not a tag of the loop's: never touched
    (checkpoints / "latest").write_text(f"step{latest}")
    return checkpoints


def left(checkpoints: Path) -> list[str]:
    return sorted((p.name for p in checkpoints.iterdir() if p.is_dir()), key=lambda n: (len(n), n))


@pytest.mark.parametrize("limit,keep,expected", [
    (3, set(), ["step4", "step5", "step6", "step9.tmp"]),
    (3, {"step2"}, ["step2", "step5", "step6", "step9.tmp"]),
    (1, {"step2"}, ["step2", "step6", "step9.tmp"]),  # the best and the latest: two, as the Trainer keeps
    (1, {"step6"}, ["step6", "step9.tmp"]),
    (10, {"step2"}, ["step1", "step2", "step3", "step4", "step5", "step6", "step9.tmp"]),
])
def test_pruning_removes_the_oldest_never_the_latest_or_the_best(tmp_path, limit, keep, expected):
    checkpoints = make_checkpoints(tmp_path, [1, 2, 3, 4, 5, 6], latest=6)
    prune_checkpoints(checkpoints, limit, keep)
    assert left(checkpoints) == expected and (checkpoints / "latest").read_text() == "step6"


def test_the_best_follows_the_figures_direction():
    lower, higher = Best("eval_reverse_kl", True), Best("eval_accuracy", False)
    evaluated = {"time/evaluation_ms": 1.0}
    for step, kl, accuracy in ((0, 0.9, 0.1), (10, 0.5, 0.4), (20, 0.7, 0.8), (30, 0.5, 0.8), (40, 0.6, 0.2)):
        record = {"step": step, "eval_reverse_kl": kl, "eval_accuracy": accuracy, **evaluated}
        lower.improved(record)
        higher.improved(record)
    assert (lower.step, lower.value) == (10, 0.5) and (higher.step, higher.value) == (20, 0.8)  # ties keep the first
    assert not lower.improved({"step": 41, "loss": 0.1})  # no evaluation at that step
    with pytest.raises(ValueError, match="--save-best eval_reverse_kl: the run's evaluation gives eval_accuracy"):
        lower.improved({"step": 50, "eval_accuracy": 1.0, **evaluated})


@pytest.mark.parametrize("metric,context,message", [
    ("loss", {}, "not an evaluation figure with a direction; one of eval_reverse_kl"),
    ("eval_accuracy", {}, "a task evaluation's figure, and the run has none: give --eval-data"),
    ("eval_pass@8", dict(task_eval=True, eval_samples=4), "gives eval_pass@1 and eval_pass@4"),
    ("eval_reverse_kl", dict(objective="sft"), "objective sft has none"),
    ("eval_reverse_kl/code", dict(teachers=("math",)), "no teacher is named 'code'"),
])
def test_a_figure_the_run_cannot_keep_its_best_by_is_refused(metric, context, message):
    with pytest.raises(ValueError, match=message):
        check_save_best(metric, **context)
    check_save_best("eval_pass@4", task_eval=True, eval_samples=4)


def test_a_run_keeps_the_best_evaluations_model_and_prunes_its_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--student", "llama-tiny", "--teacher", "qwen2-tiny", "--prompts",
                 str(write_prompts(tmp_path / "p.jsonl")), "--steps", "5", "--prompts-per-micro-batch", "2",
                 "--max-new-tokens", "6", "--eval-every", "1", "--eval-prompts", "4", "--lr", "3e-2",
                 "--save-every", "1", "--save-total-limit", "2", "--save-best", "eval_reverse_kl",
                 "--output-dir", str(out), "--quiet"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kl = {r["step"]: r["eval_reverse_kl"] for r in records}
    best_step = min(kl, key=lambda step: (kl[step], step))
    note = json.loads((out / "best" / "best.json").read_text())
    assert note == {"step": best_step, "metric": "eval_reverse_kl", "value": kl[best_step], "lower_is_better": True}
    assert f"best model {out / 'best'} (step {best_step}, eval_reverse_kl" in capsys.readouterr().out
    tags = {p.name for p in (out / "checkpoints").iterdir() if p.is_dir()}
    kept = {"step5", *([f"step{best_step}"] if best_step else [])}
    assert kept <= tags and len(tags) == max(2, len(kept)), tags
    assert (out / "checkpoints" / "latest").read_text().strip() == "step5"
    best = load_file(str(out / "best" / "model.safetensors"))
    if best_step:  # the weights of that step, as its DeepSpeed checkpoint holds them
        saved = torch.load(out / "checkpoints" / f"step{best_step}" / "mp_rank_00_model_states.pt",
                           weights_only=False)["module"]
        assert all(torch.equal(best[name], saved[name]) for name in best)
    final = load_file(str(out / "model" / "model.safetensors"))
    assert any(not torch.equal(best[name], final[name]) for name in best) == (best_step != 5)


def test_a_resumed_run_goes_on_from_the_best_it_kept(tmp_path):
    (tmp_path / "best").mkdir()
    kept = Best("eval_accuracy", False, step=20, value=0.8)
    (tmp_path / "best" / "best.json").write_text(kept.note())
    resumed = Best.of("eval_accuracy", tmp_path)
    assert (resumed.step, resumed.value, resumed.lower_is_better) == (20, 0.8, False)
    assert not resumed.improved({"step": 30, "eval_accuracy": 0.7, "time/evaluation_ms": 1.0})
    assert Best.of("eval_reverse_kl", tmp_path).step is None  # kept by another figure: a fresh start
