"""Checking a DeepSpeed config a user hands us (``train --deepspeed``), before any engine work.

DeepSpeed ignores a top-level key it does not read (a misspelt ``zero_optimisation`` trains as ZeRO-0 without a
word) and refuses a bad value in a pydantic section by a dump of several lines naming neither file nor section.
``check_deepspeed_config`` warns of each unknown top-level key with the nearest known one, and makes a refusal one
line: the file, the key path, the value and what is allowed. What is known comes from the installed DeepSpeed: the
keys ``DeepSpeedConfig`` reads (recorded as it reads) and those looked up by name outside that reading (found in
the source). Sections are checked by DeepSpeed's own models, which refuse an unknown key (``extra="forbid"``).

The configs the package builds itself share one default learning rate, ``LEARNING_RATE``.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import difflib
import enum
import inspect
import json
import logging
import textwrap
import typing
from collections.abc import Iterable, Iterator
from typing import Any

from opsd_rollout import checks

logger = logging.getLogger(__name__)

LEARNING_RATE = 1e-3
"""The student's AdamW learning rate wherever the package builds its DeepSpeed config and none is given: ``train``'s
built config (``OptimizationConfig.lr``, ``--lr``), the ``step`` bench's student (``--lr``) and
``deepspeed_engine.build_engine``. One rate, ``train``'s: the one its recipes were measured at (docs/TRAINING.md), so
the bench times the step ``train`` takes and the library's ``opsd_step`` on a built engine learns as ``train`` does."""


def read_deepspeed_file(path: str) -> dict[str, Any]:
    """A DeepSpeed config file read: a ``ValueError`` naming ``--deepspeed`` and the file when it is missing, not
    JSON, or not a JSON object (light: the command line checks the file before DeepSpeed loads)."""
    try:
        with open(path) as handle:
            ds = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"--deepspeed {str(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--deepspeed {str(path)!r} is not JSON: {error}") from None
    if not isinstance(ds, dict):
        raise ValueError(f"--deepspeed {str(path)!r} must hold a JSON object")
    return ds


def check_deepspeed_config(ds: dict[str, Any], source: str = "deepspeed config") -> list[str]:
    """Refuses (``ValueError``, one line naming ``source`` and the key) what DeepSpeed would refuse, and warns of
    each top-level key DeepSpeed would ignore; returns the warnings logged. ``ds`` is not changed."""
    with _deepspeed_quiet():
        known = _refuse(ds, source) | _named_lookups()
    warnings = [f"{source}: unknown key {key!r}{_nearest(key, known)}; DeepSpeed ignores it"
                for key in ds if key not in known]
    for warning in warnings:
        logger.warning(warning)
    return warnings


def known_keys() -> set[str]:
    """The top-level keys the installed DeepSpeed reads of a config without sections (a section can make it read
    more: the old ``"zero_optimization": true`` form reads ``allgather_size``)."""
    with _deepspeed_quiet():
        return set(_read(_Recorder({}))) | _named_lookups()


def refusal(error: BaseException) -> str:
    """One line for an error DeepSpeed raised about its config; a pydantic ``ValidationError`` would print several,
    and the whole model."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        return _describe(error.errors(include_url=False), "", None)
    return f"{type(error).__name__}: {_line(error)}" if isinstance(error, (KeyError, TypeError)) else _line(error)


class _Recorder(dict):
    """A config that notes each top-level key read from it, in order: ``in``, ``get``, ``[]``, ``keys()``."""

    def __init__(self, items: dict[str, Any]):
        super().__init__(items)
        self.read: list[Any] = []

    def __contains__(self, key: object) -> bool:
        self.read.append(key)
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.append(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.append(key)
        return super().__getitem__(key)

    def keys(self) -> _Recorder:  # type: ignore[override]  # ``KEY in config.keys()`` is read through __contains__
        return self

    def __bool__(self) -> bool:  # ``config and KEY in config`` asks for KEY of an empty config too
        return True


def _read(recorder: _Recorder) -> list[Any]:
    """The keys ``DeepSpeedConfig`` reads, reading the config as it will at initialize (so raising what it would
    raise then), less its rank, world and batch-size steps (the loop fills the sizes in later)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    object.__new__(DeepSpeedConfig)._initialize_params(recorder)
    return recorder.read


def _refuse(ds: dict[str, Any], source: str) -> set[str]:
    """Raises, as one line, what DeepSpeed would raise of ``ds``; returns the top-level keys it read."""
    from deepspeed.runtime import config as ds_config

    try:  # the keys of features DeepSpeed dropped, which it refuses by name
        getattr(ds_config, "_reject_removed_config_keys", lambda ds: None)(ds)
    except ds_config.DeepSpeedConfigError as error:
        raise ValueError(f"{source}: {_line(error)}") from None
    _check_batch_sizes(ds, source)
    for path, model in _sections():
        _check_section(ds, path, model, source)
    recorder = _Recorder(copy.deepcopy(ds))
    try:
        return {key for key in _read(recorder) if isinstance(key, str)}
    except (AttributeError, TypeError) as error:  # a section that is not an object: name the key being read
        where = f"{recorder.read[-1]}: " if recorder.read else ""
        raise ValueError(f"{source}: {where}{_line(error)}") from None
    except (AssertionError, KeyError, ValueError, ds_config.DeepSpeedConfigError) as error:
        raise ValueError(f"{source}: {refusal(error)}") from None


@contextlib.contextmanager
def _deepspeed_quiet() -> Iterator[None]:
    """DeepSpeed's own warnings about the config (a deprecated key) are left to initialize, which reads it again."""
    from deepspeed.utils import logger as ds_logger

    disabled, ds_logger.disabled = ds_logger.disabled, True
    try:
        yield
    finally:
        ds_logger.disabled = disabled


def _named_lookups() -> set[str]:
    """Top-level keys looked up outside that reading, found in the source: ``"key" in config``, ``config["key"]``
    or ``config.get("key")`` (``self._param_dict`` too), the key a literal or a module constant."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    found = set()
    for function in (deepspeed.initialize, DeepSpeedConfig.__init__, DeepSpeedConfig._do_warning_check):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError):  # an install without its source: those few keys go unknown
            continue
        for node in ast.walk(tree):
            mapping, key = _lookup(node)
            if mapping is not None and ast.unparse(mapping) in ("config", "self._param_dict"):
                name = (key.value if isinstance(key, ast.Constant)
                        else function.__globals__.get(key.id) if isinstance(key, ast.Name) else None)
                found |= {name} if isinstance(name, str) else set()
    return found


def _lookup(node: ast.AST) -> tuple[Any, Any]:
    """(mapping, key) of ``key in mapping``, ``mapping[key]`` or ``mapping.get(key, ...)``; else (None, None)."""
    if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In):
        return node.comparators[0], node.left
    if isinstance(node, ast.Subscript):
        return node.value, node.slice
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return node.func.value, node.args[0]
    return None, None


def _sections() -> list[tuple[str, Any]]:
    """DeepSpeed's pydantic model of each section ``DeepSpeedConfig`` builds one from, by key path."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    monitors = [(name, field.annotation) for name, field in DeepSpeedMonitorConfig.model_fields.items()]
    return [("zero_optimization", DeepSpeedZeroConfig), ("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config),
            ("bfloat16", DeepSpeedBF16Config), ("hybrid_engine", HybridEngineConfig), ("compile", CompileConfig),
            ("tensor_parallel", TPTrainingConfig), ("comms_logger", CommsLoggerConfig),
            ("timers.throughput", DeepSpeedThroughputTimerConfig), *monitors]


def _check_section(ds: dict[str, Any], path: str, model: Any, source: str) -> None:
    from pydantic import ValidationError

    section: Any = ds
    for part in path.split("."):
        section = section.get(part) if isinstance(section, dict) else None
    if section is None or (path == "zero_optimization" and isinstance(section, bool)):  # bool: DeepSpeed's old form
        return
    if not isinstance(section, dict):
        raise ValueError(f"{source}: {path}: {checks.quoted(section)} is not allowed; allowed: a JSON object")
    try:
        model(**section)
    except ValidationError as error:
        raise ValueError(f"{source}: {_describe(error.errors(include_url=False), path, model)}") from None
    except AssertionError as error:  # a deprecated key given with the key replacing it
        raise ValueError(f"{source}: {path}: {_line(error)}") from None


def _check_batch_sizes(ds: dict[str, Any], source: str) -> None:
    """DeepSpeed takes its batch sizes unchecked and fails later in arithmetic (``"x" * 1``); they are ints > 0."""
    from deepspeed.runtime import constants

    for key in (constants.TRAIN_BATCH_SIZE, constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU,
                constants.GRADIENT_ACCUMULATION_STEPS):
        value = ds.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{source}: {key}: {checks.quoted(value)} is not allowed; allowed: an int >= 1")


def _describe(problems: list[dict[str, Any]], path: str, model: Any) -> str:
    """pydantic's first problem as ``key.path: value is not allowed; allowed: ...`` (an unknown key with the nearest
    known one), and how many more there are."""
    problem, more = problems[0], f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    loc = tuple(str(part) for part in problem["loc"])
    where = ".".join(part for part in (path, *loc) if part)
    if problem["type"] == "extra_forbidden":
        parent = where.rpartition(".")[0]
        names = [f"{parent}.{name}" if parent else name for name in _fields(_annotation(model, loc[:-1]))]
        return f"unknown key {where!r}{_nearest(where, names)}; DeepSpeed refuses it{more}"
    message = problem["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if not loc:
        return f"{where}: {message}{more}" if where else message + more
    choices = _choices(_annotation(model, loc)) if problem["type"] in ("enum", "literal_error") else None
    allowed = f"allowed: {choices}" if choices else message[:1].lower() + message[1:]
    return f"{where}: {checks.quoted(problem['input'])} is not allowed; {allowed}{more}"


def _annotation(model: Any, loc: tuple[str, ...]) -> Any:
    """The type at key path ``loc`` in ``model`` and the models nested in it (``None`` where there is none)."""
    annotation = model
    for part in loc:
        field = _fields(annotation).get(part)
        annotation = field.annotation if field is not None else None
    return annotation


def _fields(annotation: Any) -> dict[str, Any]:
    """The fields, by name and by alias (DeepSpeed takes either), of the model an annotation is or holds."""
    model = next((t for t in (annotation, *typing.get_args(annotation)) if hasattr(t, "model_fields")), None)
    fields = getattr(model, "model_fields", {})
    return {**fields, **{field.alias: field for field in fields.values() if field.alias}}


def _choices(annotation: Any) -> str | None:
    """The values of an enum (an ``Optional`` one too), as JSON writes them; pydantic's message lists a Literal's."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return ", ".join(checks.quoted(member.value) for member in candidate)
    return None


def _nearest(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
