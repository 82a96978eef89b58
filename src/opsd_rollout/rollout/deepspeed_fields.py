"""DeepSpeed's ``HybridEngineRolloutConfig`` field names on ours: each read back as given, each mapped onto the
field of ours that does its work, a contradiction refused. Our config and our rollout both answer to the names as
attributes, as DeepSpeed's config and rollout do (``ReadBack``): as given, else as what ours does.

DeepSpeed's config has six fields. Two are ours by the same name (``enable_profiling``,
``continuous_cache_capacity``); the other four (``DeepSpeedFields``) are kept as given and map like this:

    use_graph_capture      True: ``compile_decode=True`` (the compiled one-token step; CUDA graphs on CUDA)
    use_shared_prefill     True: ``shared_prefill=True``; False changes nothing, since ours prefills each prompt
                           once by default and that never changes a token
    enable_cache_trimming  True: ``compact_rows=True`` (finished rows leave the batch); False changes nothing
    align_decode_fronts    nothing either way: each slot decodes from its own column after its own prompt,
                           which is what alignment achieves in DeepSpeed's shared-column layout
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from opsd_rollout import checks

IMPLIES: dict[str, tuple[str, bool]] = {
    "use_graph_capture": ("compile_decode", True),
    "use_shared_prefill": ("shared_prefill", True),
    "enable_cache_trimming": ("compact_rows", True),
}
"""DeepSpeed's name -> (our field, the value its ``True`` sets there)."""
TWO_WAY = ("use_graph_capture",)
"""The names whose ``False`` sets our field too: graph capture off is our compiled step off."""


@dataclass(frozen=True, kw_only=True)
class DeepSpeedFields:
    """DeepSpeed's rollout config fields that ours names otherwise, as they were given (``None``: not given).
    ``HybridEngineRolloutConfig(use_shared_prefill=True)`` keeps them here; the config and the rollout read them
    back under DeepSpeed's names."""

    use_graph_capture: bool | None = None
    """DeepSpeed's CUDA-graph decode; ours is ``compile_decode``, which it always equals."""
    use_shared_prefill: bool | None = None
    """DeepSpeed's shared prompt prefill; ``True`` needs ours, ``shared_prefill``."""
    align_decode_fronts: bool | None = None
    """DeepSpeed's continuous-batching layout option; ours decodes aligned either way."""
    enable_cache_trimming: bool | None = None
    """DeepSpeed's reclaiming of dead cache columns; ``True`` needs ours, ``compact_rows``."""

    def __post_init__(self) -> None:
        for name, value in self.given().items():
            checks.boolean(name, value)

    def given(self) -> dict[str, bool]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


NAMES = tuple(f.name for f in fields(DeepSpeedFields))


def read_back(name: str, config: Any, strategy: str) -> Any:
    """DeepSpeed's field ``name`` on our ``config``: as given; else what ours does, ``strategy`` being the strategy
    that runs (``enable_profiling`` and ``continuous_cache_capacity`` are ours by the same name)."""
    given = getattr(config.deepspeed, name, None)
    if given is not None:
        return given
    if name == "use_graph_capture":  # DeepSpeed's CUDA-graph decode: our compiled one-token step
        return config.compile_decode
    if name == "use_shared_prefill":  # whether prompts are prefilled once for their n samples
        return config.shared_prefill and strategy == "static"
    if name == "align_decode_fronts":  # each slot decodes from its own column, right after its own prompt
        return True
    if name == "enable_cache_trimming":  # finished rows leave the decode batch and free their memory
        return config.compact_rows
    return getattr(config, name)


class ReadBack:
    """An attribute under DeepSpeed's field name (the attribute's own), as DeepSpeed's config and rollout have one:
    ``read_back`` from our config with its strategy, or on our rollout (``on_rollout``) from the rollout's config with
    the strategy that runs (a model the static strategy cannot run falls back to ``generate``)."""

    def __init__(self, *, on_rollout: bool = False):
        self.on_rollout = on_rollout
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        if owner is None:
            return self
        if self.on_rollout:
            return read_back(self.name, owner.cfg, owner.strategy.name)
        return read_back(self.name, owner, owner.strategy)


def implied_fields(given: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The fields of ours that DeepSpeed's names ``given`` set, where ``ours`` (the fields given by name) leaves
    them unset: ``{"use_graph_capture": True}`` -> ``{"compile_decode": True}``."""
    implied = {}
    for name, value in given.items():
        if name in IMPLIES and IMPLIES[name][0] not in ours:
            field, setting = IMPLIES[name]
            if value is True:
                implied[field] = setting
            elif name in TWO_WAY:
                implied[field] = value
    return implied


def contradiction(deepspeed: DeepSpeedFields, config: Any) -> str | None:
    """Why ``config``'s own fields contradict DeepSpeed's names as given (``None`` when they agree)."""
    given = deepspeed.given()
    if "use_graph_capture" in given and given["use_graph_capture"] != config.compile_decode:
        return (f"use_graph_capture={given['use_graph_capture']} contradicts compile_decode={config.compile_decode}: "
                "DeepSpeed's graph capture is our compiled decode step; give one of the two")
    for name, (field, setting) in IMPLIES.items():
        if given.get(name) is True and getattr(config, field) != setting:
            return (f"{name}=True needs {field}={setting} (what DeepSpeed's field maps onto here); got "
                    f"{field}={getattr(config, field)}")
    if given.get("use_graph_capture") or given.get("use_shared_prefill"):
        if config.strategy != "static":
            named = "use_graph_capture" if given.get("use_graph_capture") else "use_shared_prefill"
            return (f"{named}=True needs strategy='static' (our decode loop does it; transformers' generate "
                    f"cannot); got strategy={config.strategy!r}")
    return None
