"""Where a training run's figures go: ``metrics.jsonl`` (one record per optimizer step), DeepSpeed's own monitor
(the ``tensorboard``, ``wandb`` and ``csv_monitor`` sections of its config), a live progress line, and at the end a
plot of the held-out curves. Every key of a record, and its name in the monitors, is ``metrics.TRAINING``'s."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from opsd_rollout.files import save_figure_atomic, write_text_atomic
from opsd_rollout.metrics import (RECORD_ROLLOUT_STAGES, ROLLOUT_PREFIX, STEP_STAGES, TIME, hidden_share,
                                  training_metric)


def step_record(step: int, profiles: list[Any], *, step_ms: float, learning_rate: float, on_policy: bool | None,
                divergence: str, epoch: float, teacher: str | None = None,
                teacher_context: str | None = None) -> dict[str, Any]:
    """One optimizer step's record from its micro-batches' ``StepProfile``s: times and tokens summed, the loss the
    token-weighted mean, memory the largest, the gradient norm the step's (the last micro-batch's: the one that
    stepped the optimizer)."""
    tokens = sum(p.response_tokens for p in profiles)
    loss = sum(p.loss * p.response_tokens for p in profiles) / max(tokens, 1)
    norm = next((p.grad_norm for p in reversed(profiles) if p.grad_norm is not None), None)
    record: dict[str, Any] = {
        "step": step, "epoch": epoch, "loss": finite(loss), **teacher_losses(profiles), "grad_norm": finite(norm),
        "learning_rate": learning_rate, "divergence": divergence, "teacher": teacher,
        "teacher_context": teacher_context, "on_policy": on_policy,
        "micro_batches": len(profiles), "response_tokens": tokens,
        "tokens_per_second": tokens / (step_ms / 1e3) if step_ms > 0 else 0.0, "time/step_ms": step_ms}
    times = {name: sum(getattr(p, name) for p in profiles) for name in ("total_ms", *STEP_STAGES)}
    record.update({TIME + name: value for name, value in times.items()})
    latency = sum(p.teacher_latency_ms for p in profiles)
    if latency > 0:  # a served teacher
        record["time/teacher_latency_ms"] = latency
        record["time/teacher_hidden_share"] = hidden_share(times["teacher_wait_ms"], latency)
    producing = times["eval_ms"] + times["rollout_ms"] + times["train_ms"]
    record["time/rollout_share"] = producing / times["total_ms"] if times["total_ms"] > 0 else 0.0
    for stage in RECORD_ROLLOUT_STAGES:
        values = [getattr(p.rollout, stage, None) for p in profiles if p.rollout is not None]
        if any(v is not None for v in values):
            record[TIME + ROLLOUT_PREFIX + stage] = sum(v or 0.0 for v in values)
    record["peak_memory_bytes"] = max((max(p.peak_memory_bytes.values(), default=0) for p in profiles), default=0)
    record["teacher_cache_bytes"] = max((p.teacher_cache_bytes for p in profiles), default=0)
    record["rss_bytes"] = psutil.Process().memory_info().rss  # after the step: flat over a run, or a leak
    return record


def finite(value: float | None) -> float | None:
    """``value``, or ``None`` when it is not a finite number (a skipped step's loss or gradient norm: ``null`` in
    JSON, where NaN is not a number any reader takes)."""
    return value if value is not None and math.isfinite(value) else None


def teacher_losses(profiles: list[Any]) -> dict[str, float]:
    """With several teachers, each one's loss over the step (``loss/NAME``): token-weighted over the micro-batches
    that routed it tokens."""
    tokens: dict[str, int] = {}
    sums: dict[str, float] = {}
    for profile in profiles:
        for name, count in profile.teacher_tokens.items():
            tokens[name] = tokens.get(name, 0) + count
            sums[name] = sums.get(name, 0.0) + profile.teacher_losses[name] * count
    return {f"loss/{name}": finite(sums[name] / tokens[name]) for name in tokens if tokens[name]}


def read_records(path: Path) -> list[dict[str, Any]]:
    """A ``metrics.jsonl``'s records; a line cut by a kill is dropped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """``metrics.jsonl``: each record one line, written whole and flushed, so the file stays valid whenever the
    run stops. A resumed run first drops the records past the step it resumes from."""

    def __init__(self, path: Path, *, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and path.exists():
            kept = [r for r in read_records(path) if r.get("step", math.inf) <= resume_step]
        write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))
        self.records = kept

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()


def monitor_events(record: dict[str, Any]) -> list[tuple[str, float, int]]:
    """The record's numbers as DeepSpeed monitor events, each under its key's ``monitor`` name in
    ``metrics.TRAINING`` (``train/loss``, ``time/rollout_ms``, ``eval/reverse_kl``); labels, ``None`` and the step
    itself are not sent."""
    events = []
    for key, value in record.items():
        registered = training_metric(key)
        if registered is None:
            raise ValueError(f"training record key {key!r} is not in metrics.TRAINING: register it there (its unit, "
                             "merge rule, direction and monitor name)")
        tag = registered.monitor
        if tag is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        events.append((tag, float(value), record["step"]))
    return events


class Progress:
    """A live line: step, loss, tokens/s, rollout share (of a step that rolled out) and ETA (rewritten in place on a
    terminal, every tenth of the run otherwise)."""

    def __init__(self, total_steps: int, first_step: int, *, enabled: bool = True, stream: Any = None):
        self.total, self.first, self.enabled = total_steps, first_step, enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()
        self.every = max(1, total_steps // 10)

    def line(self, record: dict[str, Any]) -> str:
        done = record["step"] - self.first
        elapsed = time.perf_counter() - self.start
        left = (self.total - record["step"]) * elapsed / done if done > 0 else float("nan")
        rolled = record.get(TIME + "rollout_ms", 0) > 0  # SFT and the references' steps roll nothing out
        loss = f"loss {record['loss']:.4f}" if record["loss"] is not None else "loss -"
        if "nonfinite" in record:
            loss = f"skipped (non-finite {record['nonfinite']})"
        text = (f"step {record['step']}/{self.total}  {loss}  {record['tokens_per_second']:,.0f} tok/s  "
                + (f"rollout {record['time/rollout_share']:.0%}  " if rolled else "") + f"ETA {_duration(left)}")
        if "eval_reverse_kl" in record:
            text += f"  eval reverse KL {record['eval_reverse_kl']:.4f}"
        if "eval_accuracy" in record:
            text += f"  accuracy {record['eval_accuracy']:.1%}"
        return text

    def show(self, record: dict[str, Any]) -> None:
        if not self.enabled or "loss" not in record:
            return
        last = record["step"] == self.total
        if self.tty:
            print("\r" + self.line(record).ljust(100), end="\n" if last else "", file=self.stream, flush=True)
        elif last or record["step"] % self.every == 0 or "time/evaluation_ms" in record:
            print(self.line(record), file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


TASK_PANEL = "task"
"""``plot_eval``'s panel of the task evaluation's figures (``eval_accuracy``, ``eval_pass@1``, ``eval_pass@K``)."""


def _panels(records: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Panel -> curve name -> (step, value): the held-out reverse KL, the cross-entropy, the task figures; the
    panels with no point left out."""
    def curve(name: str) -> list[tuple[int, float]]:
        return [(r["step"], r[name]) for r in records if r.get(name) is not None]

    task = sorted({key for r in records for key in r if key == "eval_accuracy" or key.startswith("eval_pass@")},
                  key=lambda key: (key != "eval_accuracy", len(key), key))
    panels = {"eval_reverse_kl": {"eval_reverse_kl": curve("eval_reverse_kl")},
              "eval_cross_entropy": {"eval_cross_entropy": curve("eval_cross_entropy")},
              TASK_PANEL: {name: curve(name) for name in task}}
    return {panel: curves for panel, curves in panels.items() if any(curves.values())}


def plot_eval(records: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """The held-out curves (reverse KL to the teacher, cross-entropy on the references) and the task evaluation's
    (greedy accuracy, pass@1, pass@K, the teacher's figures as dashed lines) against the optimizer step, as a PNG;
    ``None`` without matplotlib or without an evaluation."""
    panels = _panels(records)
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    titles = {"eval_reverse_kl": "held-out reverse KL to the teacher",
              "eval_cross_entropy": "held-out cross-entropy on the references", TASK_PANEL: "task evaluation"}
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for axis, (panel, curves) in zip(axes[0], panels.items()):
        for name, points in curves.items():
            line, = axis.plot([s for s, _ in points], [v for _, v in points], marker="o",
                              label=name.removeprefix("eval_") if panel == TASK_PANEL else None)
            teacher = next((r["teacher_" + name] for r in records if r.get("teacher_" + name) is not None), None)
            if teacher is not None:
                axis.axhline(teacher, color=line.get_color(), linestyle="--", linewidth=1,
                             label=f"teacher {name.removeprefix('eval_')}")
        warm = [r["step"] for r in records if r.get("divergence") == "cross_entropy"]
        distilled = [r["step"] for r in records if r.get("divergence") not in (None, "cross_entropy")]
        if warm and distilled:  # a warm start, then the distillation: both phases on one axis
            axis.axvspan(0, max(warm), color="0.9", zorder=0, label="warm start (SFT)" if panel == TASK_PANEL else None)
        axis.set_title(titles[panel], fontsize=10)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("fraction of problems" if panel == TASK_PANEL else "nats / token")
        if panel == TASK_PANEL:
            axis.set_ylim(-0.02, 1.02)
            axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    save_figure_atomic(figure, path, dpi=100)
    plt.close(figure)
    return path
