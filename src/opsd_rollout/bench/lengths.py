"""Response lengths of a benchmark workload: ``fixed`` (EOS ignored: every row runs to the cap), ``natural``
(the model's own EOS), or a synthetic distribution forced on any engine, e.g. ``lognormal:median=48,sigma=1.0``
``geometric:mean=64`` or ``uniform:low=8,high=256`` (integers, both ends included), capped at ``max_new_tokens``.

A synthetic length is forced token by token: before each token a row stops (its logits become "EOS only")
with the distribution's hazard at that length, else EOS is forbidden. The coin is a hash of the row's own
content (its prompt's real tokens and what it generated so far) and the token's index, so it does not depend
on the row's index in the batch: continuous batching, compaction and another engine's order all force the same
lengths on the same rows. A row's sample index within its prompt is mixed in: the n samples of a prompt draw
their lengths independently even where their content is the same. ``bench/workload.py`` forces them, on our
rollout through its row logits processor and inside transformers' ``generate`` (and so DeepSpeed's rollout)
through a ``LogitsProcessor`` (this module is light: the command line reads it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KINDS = {"fixed": (), "natural": (), "lognormal": ("median", "sigma"), "geometric": ("mean",),
         "uniform": ("low", "high")}


@dataclass(frozen=True)
class LengthModel:
    """A workload's response-length model; ``LengthModel.parse("lognormal:median=48,sigma=1")``."""

    kind: str
    params: tuple[tuple[str, float], ...] = field(default=())

    @classmethod
    def parse(cls, spec: str) -> "LengthModel":
        kind, _, rest = str(spec).strip().lower().partition(":")
        if kind not in KINDS:
            raise ValueError(f"response lengths {spec!r}: kind must be one of {list(KINDS)}")
        params: dict[str, float] = {}
        for item in filter(None, rest.split(",")):
            name, _, value = item.partition("=")
            try:
                params[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"response lengths {spec!r}: {item!r} is not name=number") from None
        if set(params) != set(KINDS[kind]):
            raise ValueError(f"response lengths {spec!r}: {kind} takes {list(KINDS[kind]) or 'no parameters'}")
        if any(value <= 0 for value in params.values()):
            raise ValueError(f"response lengths {spec!r}: parameters must be > 0")
        if kind == "uniform" and not (params["low"] == int(params["low"]) and params["high"] == int(params["high"])
                                      and params["low"] <= params["high"]):
            raise ValueError(f"response lengths {spec!r}: uniform takes integers low <= high")
        return cls(kind, tuple(sorted(params.items())))

    @property
    def synthetic(self) -> bool:
        return bool(KINDS[self.kind])

    @property
    def spec(self) -> str:
        return self.kind + (":" + ",".join(f"{k}={v:g}" for k, v in self.params) if self.params else "")

    def probabilities(self, cap: int) -> list[float]:
        """P(length = l) for l = 1..cap; what the distribution puts beyond the cap stays at the cap."""
        p = dict(self.params)
        if self.kind == "geometric":
            stop = 1.0 / max(p["mean"], 1.0)
            mass = [stop * (1 - stop) ** (length - 1) for length in range(1, cap + 1)]
        elif self.kind == "uniform":
            low, high = int(p["low"]), int(p["high"])
            mass = [1.0 / (high - low + 1) if low <= length <= high else 0.0 for length in range(1, cap + 1)]
        else:  # lognormal, rounded to the nearest length
            def cdf(x: float) -> float:
                return 0.5 * (1 + math.erf((math.log(x) - math.log(p["median"])) / (p["sigma"] * math.sqrt(2))))
            mass = [cdf(length + 0.5) - (cdf(length - 0.5) if length > 1 else 0.0) for length in range(1, cap + 1)]
        mass[-1] += max(0.0, 1.0 - sum(mass))
        return mass

    def hazards(self, cap: int) -> list[float]:
        """At generated-token index j, P(length = j + 1 | length > j); 0 at the cap (rows reaching it end there
        without an EOS)."""
        mass, left, out = self.probabilities(cap), 1.0, []
        for index in range(cap):
            out.append(mass[index] / left if left > 1e-12 and index < cap - 1 else 0.0)
            left -= mass[index]
        return out
