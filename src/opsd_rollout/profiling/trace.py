"""Chrome / Perfetto trace export: one process per traced rollout, stages nested by time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opsd_rollout.profiling.recorder import Span


def chrome_trace(rollouts: Sequence[tuple[str, Sequence[Span]]]) -> dict[str, Any]:
    """``{"traceEvents": [...]}`` with complete ("X") events in microseconds; open in ui.perfetto.dev or
    chrome://tracing. Each ``(label, spans)`` pair becomes one process named ``label``; the spans of one
    rollout all sit on one thread, so the viewer nests them by their intervals."""
    events: list[dict[str, Any]] = []
    for pid, (label, spans) in enumerate(rollouts, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "rollout"}})
        decode_step = 0
        for span in sorted(spans, key=lambda s: (s.start_ms, -s.duration_ms)):
            name = "rollout" if span.name == "total" else span.name  # a step's root is "step"
            if span.name == "decode forward":
                name = f"decode step {decode_step}"
                decode_step += 1
            events.append({"ph": "X", "name": name, "cat": span.parent or "rollout", "pid": pid, "tid": 0,
                           "ts": round(span.start_ms * 1e3, 3), "dur": round(span.duration_ms * 1e3, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
