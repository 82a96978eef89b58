"""``opsd-rollout bench``: rollouts (``HybridEngineRollout.generate``) over a matrix of shapes, each iteration
one profiled call."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, ClassVar

from rich.table import Table

from opsd_rollout.bench.axes import KEY_AXES, ROLLOUT_AXES, axis_defaults
from opsd_rollout.bench.contenders import CONTENDERS
from opsd_rollout.bench.facts import decode_bytes_per_step, prefill_flops, roofline
from opsd_rollout.bench.plots import VISIBLE_SHARE
from opsd_rollout.bench.report import ConfigResult
from opsd_rollout.bench.tables import baseline_table, config_table, fmt, mib, roofline_table, stability_table
from opsd_rollout.bench.scenarios.base import MeasuringSettings, Scenario
from opsd_rollout.checks import boolean, choice, integer, number, rule
from opsd_rollout.bench.stats import median_index
from opsd_rollout.metrics import ROLLOUT_STAGES, label

PROMPT_KINDS = ("synthetic", "variable")


class RolloutPoint:
    """What a rollout config says of itself; its fields are the axes' (``RolloutConfig``). A knob that does not apply
    to the config's contender (``strategy``) is ``None`` (n/a: ``axes.for_contender``)."""

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size * self.samples_per_prompt

    @property
    def engine_key(self) -> tuple[str, int | str]:
        """Configs with the same key share a built engine."""
        return (self.dtype, self.zero_stage)

    @property
    def key(self) -> str:
        """Stable identity, used to match results across runs (``--resume-results``, ``compare``): each axis's
        fragment (``Axis.fragment``: a knob only away from its default, so files written before it was an axis
        keep their keys, and not at all where it does not apply)."""
        return "-".join(filter(None, (axis.fragment(getattr(self, axis.field)) for axis in KEY_AXES)))

    @property
    def label(self) -> str:
        """Short, for tables and plots: the axes that usually vary."""
        return f"B{self.batch_size} n{self.samples_per_prompt} P{self.prompt_length} R{self.response_length}"

    @property
    def engine_fields(self) -> dict[str, Any]:
        """The contender's ``strategy`` and our rollout's ``HybridEngineRolloutConfig.from_flat`` fields of this
        config's engine axes (those n/a left out)."""
        knobs = {axis.engine: getattr(self, axis.field) for axis in ROLLOUT_AXES if axis.engine}
        return {"strategy": self.strategy, **{name: value for name, value in knobs.items() if value is not None}}


RolloutConfig = make_dataclass("RolloutConfig", [(a.field, Any, field(default=a.default)) for a in ROLLOUT_AXES],
                               bases=(RolloutPoint,), frozen=True, kw_only=True)
"""One point of a rollout matrix: a field per axis of ``ROLLOUT_AXES``, at its default."""


@dataclass(kw_only=True)
class RolloutSettings(MeasuringSettings):
    """Everything about a rollout benchmark that is not an axis."""

    prompts: str = "synthetic"
    """``synthetic``: every prompt exactly ``prompt_length`` tokens; ``variable``: left-padded, lengths vary."""
    pad_fraction: float = 0.25
    """With ``prompts=variable``, the mean fraction of the prompt grid that is padding."""
    temperature: float = 1.0
    """Sampling temperature (decoding=sampling)."""
    top_k: int = 50
    """Sampling top-k (decoding=sampling; <= 0 disables, as in DeepSpeed)."""
    top_p: float = 1.0
    """Sampling top-p (decoding=sampling)."""
    interleave: bool = False
    """Run the configs of one workload (alike but for the contender and its own knobs: ``bench/contenders/``)
    round by round in one process, one iteration of each per round, the order reversed every other round, each
    warmed up first; ``False``: one config after the other."""
    baseline: str | None = None
    """The contender (one of the ``strategies``) each config's ratio is against; ``None``: the first listed."""

    rules: ClassVar = {
        **MeasuringSettings.rules,
        "prompts": rule(choice, choices=PROMPT_KINDS),
        "pad_fraction": rule(number, at_least=0, below=1),
        "temperature": rule(number, above=0, hint="for sampling; greedy is decoding=greedy"),
        "top_k": rule(integer, minimum=None, hint="<= 0 disables top-k"),
        "top_p": rule(number, above=0, at_most=1),
        "interleave": boolean, "baseline": rule(choice, choices=(None, *CONTENDERS))}


class RolloutMeasurement:
    """One config's rollout, built: each ``run()`` is one profiled ``generate``."""

    def __init__(self, rollout: Any, request: Any, sampling: Any):
        self.rollout, self.request, self.sampling = rollout, request, sampling

    def run(self) -> dict[str, Any]:
        self.rollout.generate(self.request, self.sampling)
        return self.rollout.get_last_profile().to_dict()

    def timeline(self) -> list:
        return self.rollout.get_last_timeline() or []


def median_shares(result: ConfigResult) -> dict[str, float]:
    """Stage shares of the iteration whose total is the median one (the lower of two middles)."""
    from opsd_rollout.bench.reference import without_reference  # heavy: see scenarios/base.py
    from opsd_rollout.profiling.profile import RolloutProfile

    if not result.iterations:
        return {}
    middle = median_index([it["total_ms"] for it in result.iterations])
    return RolloutProfile(**without_reference(result.iterations[middle])).stage_shares()


class RolloutScenario(Scenario):
    kind = "rollout"
    axes = ROLLOUT_AXES
    config_type = RolloutConfig
    settings_type = RolloutSettings
    defaults: ClassVar[dict[str, list[Any]]] = {
        **axis_defaults(ROLLOUT_AXES), "batch_sizes": [1, 4], "samples_per_prompt": [1, 4], "prompt_lengths": [128],
        "response_lengths": [32]}
    stages = ROLLOUT_STAGES
    what = "rollout"
    throughput_label = "generated tokens/s (p50)"

    def prepare(self, pool: Any, config: Any) -> RolloutMeasurement:
        from opsd_rollout.bench.prompts import rollout_inputs  # heavy: see scenarios/base.py

        rollout, built = pool.rollout(config)
        request, sampling = rollout_inputs(config, self.settings, built.tokenizer, built.spec.vocab_size,
                                           pool.rank, pool.device)
        return RolloutMeasurement(rollout, request, sampling)

    def derive(self, result: ConfigResult, spec: Any, ceilings: dict[str, Any] | None,
               world_size: int) -> dict[str, Any]:
        """TTFT, TPOT, prefill and decode tokens/s (medians) and utilisation against the measured ceilings."""
        c, p50 = result.config, result.p50
        out: dict[str, Any] = {"time_to_first_token_ms": p50("ttft_ms"), "time_per_output_token_ms": p50("tpot_ms"),
                               "prefill_tokens_per_second": p50("prefill_tokens_per_second"),
                               "decode_tokens_per_second": p50("decode_tokens_per_second"),
                               "real_tokens_per_second": p50("tokens_per_second"),
                               "live_row_utilisation": p50("live_row_utilisation"),
                               "row_latency_p50_ms": p50("row_latency_p50_ms"),
                               "row_latency_p95_ms": p50("row_latency_p95_ms"),
                               "decode_bytes_per_step": None, "decode_bandwidth_bytes_per_s": None,
                               "decode_bandwidth_utilisation": None, "prefill_compute_utilisation": None}
        if spec is not None and p50("tpot_ms"):  # every row decodes, at its mean context (an estimate for a long tail)
            response = (p50("response_length") or c.response_length) / 2
            if any(it.get("kv_layout") == "shared_prefix" for it in result.iterations):  # each prompt read once
                bytes_per_step = decode_bytes_per_step(spec, c.effective_batch_size, response,
                                                       shared_prompts=c.batch_size, prompt_length=c.prompt_length)
            else:
                bytes_per_step = decode_bytes_per_step(spec, c.effective_batch_size, c.prompt_length + response)
            out.update(roofline(bytes_per_step, p50("tpot_ms"), ceilings))
        if ceilings and p50("prefill_ms") and p50("prefill_tokens"):
            # merged multi-rank iterations sum prefill tokens over ranks; the ceiling is one device's
            rows = p50("prefill_tokens") / c.prompt_length / world_size
            flops = prefill_flops(spec, round(rows), c.prompt_length)
            out["prefill_compute_utilisation"] = flops / (p50("prefill_ms") / 1e3) / ceilings["matmul_flops_per_s"]
        return out

    def tables(self, results: list[ConfigResult]) -> list[Table]:
        """Latency and throughput; where the time goes (shares of the median iteration); warm-up and noise."""

        def figures(result: ConfigResult) -> list[str]:
            total = result.metric("total_ms")
            return [fmt(total.p50) + result.spread_flag, fmt(total.p95), fmt(result.p50("ttft_ms"), 2),
                    fmt(result.p50("tpot_ms"), 2), fmt(result.p50("tokens_per_second")),
                    mib(result.p50("peak_memory_bytes"))]

        def rows(result: ConfigResult) -> list[str]:
            utilisation = result.p50("live_row_utilisation")
            return [f"{100 * utilisation:.0f}" if utilisation is not None else "-", fmt(result.p50("row_steps"), 0),
                    fmt(result.p50("row_latency_p50_ms")), fmt(result.p50("row_latency_p95_ms")),
                    fmt(result.p50("row_latency_max_ms"))]

        shares = {r.config.key: median_shares(r) for r in results if r.status == "ok"}
        stages = [k for k in self.stages if any(s.get(k, 0) >= VISIBLE_SHARE for s in shares.values())]
        ratios = baseline_table(results)
        tables = [config_table(results, "latency and throughput (medians over the iterations; tok/s: real tokens)",
                               ["p50 ms", "p95 ms", "TTFT ms", "TPOT ms", "tok/s", "peak MiB"], figures),
                  config_table(results, "where the time goes (% of the median iteration)", [label(k) for k in stages],
                               lambda r: [f"{100 * shares[r.config.key].get(k, 0.0):.0f}" for k in stages])]
        if any(r.config.lengths != "fixed" for r in results):  # rows end at different times: how they were served
            tables.append(config_table(results, "rows (medians; live rows: real tokens / row-steps computed)",
                                       ["live rows %", "row-steps", "row p50 ms", "row p95 ms", "row max ms"], rows))
        roofline = roofline_table(results, [("", "decode_")])
        return tables + [t for t in (roofline, ratios) if t is not None] + [stability_table(results)]
