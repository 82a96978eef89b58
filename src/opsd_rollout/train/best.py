"""The best model of a run (``--save-best METRIC``): after each evaluation that improves on every earlier one by
METRIC (an evaluation figure of ``metrics.TRAINING``, its direction the registry's ``lower_is_better``), the
student is written to ``best/``, whole and at once, with ``best.json`` in it naming the step and the value. Light:
no torch at import, so the command line checks the figure before any model loads."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsd_rollout.metrics import TRAINING, training_metric

BEST_DIR = "best"
NOTE = "best.json"
"""In ``best/``: ``{"step", "metric", "value", "lower_is_better"}`` of the evaluation it holds the model of."""


def best_figures() -> list[str]:
    """The figures a run can keep its best model by: the evaluation's, each with a direction."""
    return [name for name, m in TRAINING.items() if name.startswith("eval_") and m.lower_is_better is not None]


def check_save_best(metric: str | None, *, objective: str = "opsd", task_eval: bool = False,
                    eval_samples: int = 1, teachers: tuple[str, ...] = ()) -> None:
    """Refuses (one line naming ``--save-best``) a figure that is not an evaluation's, has no direction, or that the
    run's evaluations cannot give: the task's figures without ``--eval-data``, ``pass@K`` of another K than
    ``--eval-samples``, the reverse KL without a teacher or of a teacher the run lacks."""
    if metric is None:
        return
    registered = training_metric(metric) if isinstance(metric, str) else None
    if registered is None or not metric.startswith("eval_") or registered.lower_is_better is None:
        raise ValueError(f"--save-best {metric!r} is not an evaluation figure with a direction; one of "
                         f"{', '.join(best_figures())} (eval_pass@K as eval_pass@8, eval_reverse_kl/NAME per teacher)")
    task = metric in ("eval_accuracy", "eval_unextractable") or metric.startswith("eval_pass@")
    if task and not task_eval:
        raise ValueError(f"--save-best {metric}: a task evaluation's figure, and the run has none: give --eval-data "
                         "and --eval-scorer")
    if metric.startswith("eval_pass@") and metric != "eval_pass@1" and metric != f"eval_pass@{eval_samples}":
        raise ValueError(f"--save-best {metric}: the run's evaluation gives eval_pass@1 and eval_pass@{eval_samples} "
                         "(--eval-samples)")
    if metric.startswith("eval_reverse_kl") and objective != "opsd":
        raise ValueError(f"--save-best {metric}: the reverse KL to a teacher, and objective {objective} has none")
    name = metric.partition("/")[2]
    if name and name not in teachers:
        raise ValueError(f"--save-best {metric}: no teacher is named {name!r}; the run's: {', '.join(teachers)}")


@dataclass
class Best:
    """The best evaluation so far by ``metric``: its step and value (``None`` before the first)."""

    metric: str
    lower_is_better: bool
    step: int | None = None
    value: float | None = None

    @classmethod
    def of(cls, metric: str, output_dir: Path) -> Best:
        """The run's best so far: what ``best/best.json`` says (a resumed run's), if it is by the same figure."""
        best = cls(metric, bool(training_metric(metric).lower_is_better))
        note = output_dir / BEST_DIR / NOTE
        if note.is_file():
            saved = json.loads(note.read_text())
            if saved.get("metric") == metric:
                best.step, best.value = saved["step"], saved["value"]
        return best

    def improved(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` (an evaluated step's) beats the best so far; refuses one whose evaluation lacks the
        figure (what the run's evaluations give is known only once they ran: at the first)."""
        if "time/evaluation_ms" not in record:
            return False
        if self.metric not in record:
            given = sorted(key for key in record if key.startswith("eval_"))
            raise ValueError(f"--save-best {self.metric}: the run's evaluation gives {', '.join(given) or 'no figure'}"
                             f" (eval_cross_entropy needs a reference in every held-out example)")
        value = float(record[self.metric])
        if not math.isfinite(value):
            return False
        if self.value is not None and not (value < self.value if self.lower_is_better else value > self.value):
            return False
        self.step, self.value = int(record["step"]), value
        return True

    def note(self) -> str:
        """``best.json``'s text."""
        return json.dumps({"step": self.step, "metric": self.metric, "value": self.value,
                           "lower_is_better": self.lower_is_better}, indent=2) + "\n"
