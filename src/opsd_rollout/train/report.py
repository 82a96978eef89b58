"""Where a training run's figures go: ``metrics.jsonl`` (one record per optimizer step), DeepSpeed's own monitor
(the ``tensorboard``, ``wandb`` and ``csv_monitor`` sections of its config), a live progress line, and at the end a
plot of the held-out curves."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from opsd_rollout.files import write_text_atomic
from opsd_rollout.metrics import STEP_STAGES

ROLLOUT_STAGES = ("prompt_expansion_ms", "prefill_ms", "decode_ms", "post_processing_ms", "param_gather_ms",
                  "inference_cache_ms", "compile_ms", "compaction_ms")
"""The rollout profile's stages a step record carries (as ``rollout/<stage>``), summed over its micro-batches."""


def step_record(step: int, profiles: list[Any], *, wall_ms: float, lr: float, on_policy: bool | None,
                divergence: str) -> dict[str, Any]:
    """One optimizer step's record from its micro-batches' ``StepProfile``s: times and tokens summed, the loss the
    token-weighted mean, memory the largest."""
    tokens = sum(p.response_tokens for p in profiles)
    record: dict[str, Any] = {
        "step": step, "loss": sum(p.loss * p.response_tokens for p in profiles) / max(tokens, 1),
        "divergence": divergence, "on_policy": on_policy, "micro_batches": len(profiles), "response_tokens": tokens,
        "lr": lr, "wall_ms": wall_ms, "total_ms": sum(p.total_ms for p in profiles)}
    for stage in STEP_STAGES:
        record[stage] = sum(getattr(p, stage) for p in profiles)
    producing = record["eval_ms"] + record["rollout_ms"] + record["train_ms"]
    record["rollout_share"] = producing / record["total_ms"] if record["total_ms"] > 0 else 0.0
    record["tokens_per_second"] = tokens / (wall_ms / 1e3) if wall_ms > 0 else 0.0
    for stage in ROLLOUT_STAGES:
        values = [getattr(p.rollout, stage, None) for p in profiles if p.rollout is not None]
        if any(v is not None for v in values):
            record[f"rollout/{stage}"] = sum(v or 0.0 for v in values)
    record["rss_bytes"] = psutil.Process().memory_info().rss  # after the step: flat over a run, or a leak
    record["peak_memory_bytes"] = max((max(p.peak_memory_bytes.values(), default=0) for p in profiles), default=0)
    record["teacher_cache_bytes"] = max((p.teacher_cache_bytes for p in profiles), default=0)
    return record


class MetricsLog:
    """``metrics.jsonl``: each record one line, written whole and flushed, so the file stays valid whenever the
    run stops. A resumed run first drops the records past the step it resumes from."""

    def __init__(self, path: Path, *, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill: dropped
                if record.get("step", math.inf) <= resume_step:
                    kept.append(line)
        write_text_atomic(path, "".join(line + "\n" for line in kept))
        self.records = [json.loads(line) for line in kept]

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()


def monitor_events(record: dict[str, Any]) -> list[tuple[str, float, int]]:
    """The record's numbers as DeepSpeed monitor events: ``train/...``, ``profiling/...`` (times), ``eval/...``."""
    events = []
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("eval_"):
            tag = "eval/" + key.removeprefix("eval_")
        elif key.endswith("_ms"):
            tag = "profiling/" + key
        else:
            tag = "train/" + key
        events.append((tag, float(value), record["step"]))
    return events


class Progress:
    """A live line: step, loss, tokens/s, rollout share and ETA (rewritten in place on a terminal, every tenth of
    the run otherwise)."""

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
        text = (f"step {record['step']}/{self.total}  loss {record['loss']:.4f}  {record['tokens_per_second']:,.0f} "
                f"tok/s  rollout {record['rollout_share']:.0%}  ETA {_duration(left)}")
        if "eval_reverse_kl" in record:
            text += f"  eval reverse KL {record['eval_reverse_kl']:.4f}"
        return text

    def show(self, record: dict[str, Any]) -> None:
        if not self.enabled or "loss" not in record:
            return
        last = record["step"] == self.total
        if self.tty:
            print("\r" + self.line(record).ljust(100), end="\n" if last else "", file=self.stream, flush=True)
        elif last or record["step"] % self.every == 0 or "eval_reverse_kl" in record:
            print(self.line(record), file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def plot_eval(records: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """The held-out curves (reverse KL to the teacher, cross-entropy on the references) against the optimizer
    step, as a PNG; ``None`` without matplotlib or without an evaluation."""
    curves = {name: [(r["step"], r[name]) for r in records if name in r]
              for name in ("eval_reverse_kl", "eval_cross_entropy")}
    curves = {name: points for name, points in curves.items() if points}
    if not curves:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = {"eval_reverse_kl": "held-out reverse KL to the teacher",
              "eval_cross_entropy": "held-out cross-entropy on the references"}
    figure, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 3.8), squeeze=False)
    for axis, (name, points) in zip(axes[0], curves.items()):
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o")
        axis.set_title(labels[name], fontsize=10)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("nats / token")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    os.replace(tmp, path)
    return path
