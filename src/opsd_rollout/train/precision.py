"""Where a run's models live and in what precision. The student's device and dtype are its DeepSpeed engine's
(DeepSpeed's accelerator, the config's ``bf16``/``fp16`` sections); ``TrainConfig.device`` and ``dtype`` say which
(``auto``: the accelerator, bf16 on a GPU and fp32 on the CPU) and fill in a config that names no precision, and a
config that says otherwise is refused. Every teacher then follows the student: loaded in the run's dtype, and moved
to the engine's device once it is built (``place_teachers``), a ZeRO-3 one through its own engine. Light at import:
the command line checks ``--dtype`` against a DeepSpeed config before torch loads."""

from __future__ import annotations

import os
from typing import Any

from opsd_rollout.placement import engine_placement, place, resolve_device, resolve_dtype

SECTIONS = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16",)}
"""The DeepSpeed config's sections that turn a precision on, by dtype (``bfloat16``: DeepSpeed's older name)."""


def run_device_type(device: str) -> str:
    """The device type the student trains on (``cuda``, ``cpu``, ...): DeepSpeed's accelerator's, which ``device``
    (``TrainConfig.device``) must agree with unless ``auto``."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if device == "auto":
        return accelerator
    if ":" in device and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"--device {device} names one GPU, and under a launcher each rank takes its own "
                         "(LOCAL_RANK): use --device cuda")
    asked = resolve_device(device).partition(":")[0]
    if asked != accelerator:
        how = ("set DS_ACCELERATOR=cpu before DeepSpeed is imported (the command line does, for --device cpu)"
               if asked == "cpu" else "DeepSpeed found no GPU in this process (is DS_ACCELERATOR set?)")
        raise ValueError(f"--device {device}: DeepSpeed runs on {accelerator} in this process; {how}")
    return asked


def device_index(device: str) -> int | None:
    """The GPU index ``cuda:N`` names (one process: DeepSpeed's ``device_rank``); ``None`` for the others."""
    return int(device.partition(":")[2]) if ":" in device else None


def enabled(ds: dict[str, Any], dtype: str) -> bool | None:
    """What the DeepSpeed config says of ``dtype``'s section: on, off, or nothing (absent, or ``"auto"``)."""
    for name in SECTIONS[dtype]:
        section = ds.get(name)
        if isinstance(section, dict) and isinstance(section.get("enabled"), bool):
            return section["enabled"]
    return None


def run_dtype(asked: str, ds: dict[str, Any] | None, device_type: str, source: str) -> str:
    """The run's dtype (``fp32``, ``bf16``, ``fp16``): ``asked`` (``TrainConfig.dtype``), checked against the user's
    DeepSpeed config ``ds`` (``None``: one the flags build), which decides for ``auto`` when it turns a precision on
    (or turns ``auto``'s off: then fp32); one line naming both when they disagree."""
    resolved = resolve_dtype(asked, device_type)
    if ds is None:
        return resolved
    on = [dtype for dtype in SECTIONS if enabled(ds, dtype)]
    if asked == "auto":
        if on:
            return on[0]
        return "fp32" if resolved in SECTIONS and enabled(ds, resolved) is False else resolved
    against = [dtype for dtype in on if dtype != asked] + ([asked] if asked in SECTIONS and enabled(ds, asked) is
                                                           False else [])
    if against:
        said = ", ".join(f"{dtype} {'on' if enabled(ds, dtype) else 'off'}" for dtype in against)
        raise ValueError(f"--dtype {asked} and {source} disagree: its {said}; drop --dtype (the config decides) or "
                         "change the config's bf16/fp16 section")
    return asked


def with_dtype(ds: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``ds`` with ``dtype``'s section on (the name the config already uses, else DeepSpeed's own); fp32 leaves it
    as it is (``run_dtype`` found no section on)."""
    if dtype in SECTIONS:
        name = next((n for n in SECTIONS[dtype] if isinstance(ds.get(n), dict)), SECTIONS[dtype][0])
        ds[name] = {**ds.get(name, {}), "enabled": True}
    return ds


def place_teachers(teacher: Any, zero_stages: dict[str, int], engine: Any) -> Any:
    """The run's teacher (or teachers, by name) where the student runs, in its dtype (``engine_placement``): a
    module moved there, or with ZeRO stage 3 (``zero_stages`` by teacher name; a self-teacher's frozen copy under a
    ZeRO-3 student) partitioned by an inference engine of its own on the engine's device. A served teacher, and a
    self-teacher that is the student, stay as they are."""
    if isinstance(teacher, dict):
        return {name: _placed(each, zero_stages.get(name, 0), engine) for name, each in teacher.items()}
    return _placed(teacher, next(iter(zero_stages.values()), 0), engine)


def _placed(teacher: Any, zero_stage: int, engine: Any) -> Any:
    from opsd_rollout.opsd.self_teacher import SelfTeacher  # heavy: torch (this module is light at import)
    from opsd_rollout.opsd.served import ServedTeacher

    if teacher is None or isinstance(teacher, ServedTeacher):
        return teacher
    if isinstance(teacher, SelfTeacher):
        if teacher.copied:  # the student's starting weights: partitioned as the student is, or beside it
            teacher.module = _placed(teacher.module, 3 if engine.zero_optimization_stage() == 3 else 0, engine)
        return teacher
    device, dtype = engine_placement(engine)
    if zero_stage == 3:
        from opsd_rollout.deepspeed_engine import build_inference_engine

        return build_inference_engine(teacher.to(dtype=dtype), 3)  # its engine puts each partition on the device
    return place(teacher, device, dtype)
