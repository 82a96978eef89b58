"""The kernels scenario: the pieces that are neither a whole rollout nor a whole step (token selection,
post-processing, attention layouts, the fused loss, the CPU weight layout, the compiled step, profiling's cost),
each ours against a baseline, both in every iteration (this package's modules), under the same runner, statistics,
schema and ``compare`` as ``bench`` and ``step``. Its results carry ``kind: kernels``; ``opsd-rollout compare``
reads them from the document alone (it has no scenario of that kind), this module recomputes their keys."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, ClassVar

from rich.table import Table

import kernel_bench
from kernel_bench import DEFAULT_KERNELS, KERNELS, LONG, POSTPROCESS_STRATEGIES
from opsd_rollout import checks
from opsd_rollout.bench.axes import DTYPES, Axis, axis_defaults, choice_axis, positive_int, shape_axis, teacher_cache
from opsd_rollout.bench.report import ConfigResult
from opsd_rollout.bench.scenarios.base import MeasuringSettings, Scenario, threads_phrase
from opsd_rollout.bench.tables import config_table, fmt, mib, roofline_table, stability_table
from opsd_rollout.checks import integer, number, rule, text
from opsd_rollout.presets import DEFAULT_MODEL
from opsd_rollout.rollout.config import RESPONSE_WIDTHS


def any_int(value: Any) -> int:
    return checks.integer("value", checks.from_text(value, int), minimum=None)


def top_p(value: Any) -> float:
    return float(checks.number("value", checks.from_text(value, float), above=0, at_most=1))


def weight_shape(value: Any) -> str:
    """``model`` or ``KxN`` (inputs x outputs, both >= 1), e.g. ``1024x4096``."""
    text = str(value).strip().lower()
    if text == "model":
        return text
    inputs, outputs = text.split("x")
    return f"{positive_int(inputs)}x{positive_int(outputs)}"


KERNEL_AXES = (
    choice_axis("kernels", "kernel", tuple(KERNELS), "what to measure: " + "; ".join(
        f"{k.name}: {k.what}" for k in KERNELS.values()), None),
    choice_axis("dtypes", "dtype", DTYPES, "the logits' (sampling), the tensors' (fused_loss) or the model's dtype (a "
                "dtype the device cannot run is reported as skipped)", "fp32"),
    shape_axis("rows", "rows", "rows{}", "rows of the batch: logits rows (sampling), prompts x samples (postprocess, "
               "attention, profiling), loss rows (fused_loss), rows of one token (weight_layout), prompts (compile)"),
    shape_axis("vocab_sizes", "vocab_size", "V{}", "vocabulary sizes (sampling, fused_loss)"),
    shape_axis("samples_per_prompt", "samples_per_prompt", "n{}",
               "samples per prompt (postprocess, attention: at least 2, profiling); it divides --rows"),
    shape_axis("prompt_lengths", "prompt_length", "P{}",
               "prompt lengths in tokens (postprocess, attention, compile, profiling)"),
    shape_axis("response_lengths", "response_length", "R{}",
               "response lengths: new tokens (postprocess, attention, profiling), trained tokens per row (fused_loss)"),
    Axis("top_ks", "top_k", any_int, "an integer (<= 0 disables top-k)", "sampling top-k values (sampling), <= 0 "
         "disables", key="topk{}"),
    Axis("top_ps", "top_p", top_p, "a number in (0, 1]", "sampling top-p values (sampling)", key="topp{:g}"),
    Axis("teacher_caches", "teacher_cache", teacher_cache, "full or top<k> (e.g. top64)",
         "the teacher's cache (fused_loss): full (every logit) or top<k>", key="{}"),
    Axis("weight_shapes", "weight_shape", weight_shape, "model or KxN (e.g. 1024x4096)",
         "weight_layout: model (every nn.Linear of --model) or KxN (one weight of K inputs and N outputs)", key="W{}"),
    choice_axis("postprocess_strategies", "postprocess_strategy", POSTPROCESS_STRATEGIES, "postprocess: the "
                "generation our post-processing follows: generate (transformers' generate; the EOS searched for) or "
                "static (our decode loop, which hands over where each row stopped)", "generate", key="{}"),
    choice_axis("response_widths", "response_width", RESPONSE_WIDTHS, "postprocess: our batch's response columns, "
                "max_new_tokens (DeepSpeed's width, our default) or longest (trimmed to the longest response)",
                "max_new_tokens", key="{}"),
)
"""Each axis a kernel reads appears in its configs' key and label (``Axis.key``; ``None`` in the others)."""


class KernelPoint:
    """What a kernels config says of itself; its fields are the axes' (``KernelConfig``), ``None`` where its kernel
    does not read the axis."""

    def _parts(self) -> list[str]:
        return list(filter(None, (axis.fragment(getattr(self, axis.field)) for axis in KERNEL_AXES[2:])))

    @property
    def key(self) -> str:
        """Stable identity (``--resume-results``, ``compare``): the kernel, its dtype if it reads one, its other
        axes."""
        dtype = [self.dtype] if "dtype" in KERNELS[self.kernel].reads else []
        return "-".join([self.kernel, *dtype, *self._parts()])

    @property
    def label(self) -> str:
        """The kernel and its axes, then its dtype where it reads one that is not fp32."""
        dtype = [self.dtype] if "dtype" in KERNELS[self.kernel].reads and self.dtype != "fp32" else []
        return " ".join([self.kernel, *self._parts(), *dtype])

    @property
    def engine_key(self) -> tuple[str, str]:
        """Configs of one dtype share the settings' model (loaded once, bare: no DeepSpeed engine)."""
        return (self.dtype, "none")

    @property
    def zero_stage(self) -> str:
        return "none"

    @property
    def effective_batch_size(self) -> int:
        """No workspace is shared between configs: the run order is the user's (within a dtype)."""
        return 0


KernelConfig = make_dataclass("KernelConfig", [(a.field, Any, field(default=a.default)) for a in KERNEL_AXES],
                              bases=(KernelPoint,), frozen=True, kw_only=True)
"""One point of a kernels matrix: the kernel and the axes it reads."""


@dataclass(kw_only=True)
class KernelSettings(MeasuringSettings):
    """Everything about a kernels benchmark that is not an axis."""

    model: str = DEFAULT_MODEL
    """The model the attention, weight_layout (``model``), compile and profiling kernels run: a preset name or a
    local checkpoint directory."""
    temperature: float = 1.0
    """The sampling kernel's temperature."""
    repeats: int = 1
    """Calls of each side per timed sample in the sampling and weight_layout kernels (ms per call): raise it
    when one call is too short to time alone (tens of microseconds)."""
    hidden_size: int = 64
    """The fused_loss student's hidden size (its LM head is ``[vocab, hidden_size]``)."""
    beta: float = 0.5
    """The fused_loss generalized JSD's beta (0 = forward KL, 1 = reverse KL)."""

    rules: ClassVar = {
        **MeasuringSettings.rules, "model": rule(text, what="a preset name or a checkpoint directory"),
        "temperature": rule(number, above=0), "repeats": rule(integer), "hidden_size": rule(integer),
        "beta": rule(number, at_least=0, at_most=1)}


def _ms(value: float | None) -> str:
    """Three or four significant figures: kernels take from microseconds to minutes."""
    if value is None:
        return "-"
    return fmt(value, 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2 if abs(value) >= 1 else 3)


def _mib(value: float | None) -> str:
    return _ms(value / 2**20 if value is not None else None)


def _also(result: ConfigResult) -> str:
    """The kernel's own figures beside its times, ours / baseline."""
    kernel, d = result.config.kernel, result.derived
    if kernel == "sampling":
        return f"greedy {_ms(result.p50('greedy_ms'))} ms"
    if kernel == "attention":
        return f"KV {_mib(result.p50('kv_workspace_bytes'))} / {_mib(result.p50('baseline_kv_workspace_bytes'))} MiB"
    if kernel == "fused_loss":
        return f"peak {mib(result.p50('peak_memory_bytes'))} / {mib(result.p50('baseline_peak_memory_bytes'))} MiB"
    if kernel == "compile" and d.get("kernel_bandwidth_utilisation") is not None:
        shares = [d[f"{side}_bandwidth_utilisation"] for side in ("kernel", "baseline")]
        return "roofline " + " / ".join(f"{v:.0%}" if v >= 0.1 else f"{v:.1%}" for v in shares)
    return ""


class KernelsScenario(Scenario):
    kind = "kernels"
    axes = KERNEL_AXES
    config_type = KernelConfig
    settings_type = KernelSettings
    defaults: ClassVar[dict[str, list[Any]]] = {
        **axis_defaults(KERNEL_AXES), "kernels": list(DEFAULT_KERNELS), "rows": [16], "vocab_sizes": [32000],
        "samples_per_prompt": [4], "prompt_lengths": [128], "response_lengths": [32], "top_ks": [50],
        "top_ps": [0.95], "teacher_caches": ["full"], "weight_shapes": ["model"], "response_widths": ["max_new_tokens"],
        "postprocess_strategies": ["generate"]}
    stages = ("kernel_ms", "baseline_ms", "greedy_ms")
    what = "kernel round"
    throughput_label = "speed-up (baseline / ours, p50)"

    @classmethod
    def make_config(cls, **fields: Any) -> Any:
        reads = KERNELS[fields["kernel"]].reads
        kept = {name: value for name, value in fields.items() if name == "kernel" or name in reads}
        return KernelConfig(**kept)

    def check(self, matrix: Any, max_positions: Any) -> None:
        """Refuse, by name and before any work, what a kernel cannot measure: rows a sample count does not divide,
        attention without a decode step or without samples to share a prompt, a sampled teacher cache, lengths
        beyond the model's positions."""
        configs, errors = matrix.expand(), []
        for c in configs:
            if c.samples_per_prompt is not None and c.rows % c.samples_per_prompt:
                errors.append(f"{c.kernel}: rows {c.rows} are not a whole number of prompts of "
                              f"{c.samples_per_prompt} samples")
            if c.kernel == "attention" and c.samples_per_prompt < 2:
                errors.append("attention: samples_per_prompt must be >= 2 (one sample has no prompt to share)")
            if c.kernel == "attention" and c.response_length < 2:
                errors.append("attention: response_lengths must be >= 2 (decode steps follow the first token)")
            if c.kernel == "fused_loss" and c.teacher_cache == "sampled":
                errors.append("fused_loss: teacher_caches takes full or top<k> (the JSD reads the teacher's "
                              "distribution), not sampled")
        if errors:
            raise ValueError("invalid benchmark matrix:\n  " + "\n  ".join(dict.fromkeys(errors)))
        limit = max_positions(self.settings.model)  # also refuses a model that does not exist: every config loads it
        bad = {f"{c.kernel}: prompt {c.prompt_length} + response {c.response_length or LONG}" for c in configs
               if KERNELS[c.kernel].model and c.prompt_length is not None and limit is not None
               and c.prompt_length + (c.response_length or LONG) > limit}
        if bad:
            raise ValueError(f"invalid benchmark matrix: beyond the model's {limit} positions: "
                             + "; ".join(sorted(bad)))

    def prepare(self, pool: Any, config: KernelConfig) -> Any:
        return kernel_bench.prepare(config, self.settings, pool.get(config), pool.device)

    def derive(self, result: ConfigResult, spec: Any, ceilings: dict[str, Any] | None,
               world_size: int) -> dict[str, Any]:
        """Medians of both sides and of their per-round ratio; whether every round's outputs agreed; for the
        compiled step, each side's share of the copy bandwidth."""
        out: dict[str, Any] = {name: result.p50(name) for name in ("kernel_ms", "baseline_ms", "speedup")}
        equal = [it["outputs_equal"] for it in result.iterations if "outputs_equal" in it]
        out["outputs_equal"] = all(equal) if equal else None
        c, positive = result.config, min(out["kernel_ms"] or 0, out["baseline_ms"] or 0) > 0
        if c.kernel == "compile" and spec is not None and positive:
            from kernel_bench.compile import step_roofline

            out.update(step_roofline(spec, c.rows, c.prompt_length,
                                     {side: out[f"{side}_ms"] for side in ("kernel", "baseline")}, ceilings))
        return out

    def title(self, environment: dict[str, Any], world_size: int) -> str:
        s = self.settings
        return (f"kernels on {environment['device_name']} ({threads_phrase(environment, world_size)}), "
                f"{s.iterations} rounds after {self.warmup_phrase('round')}; each round both sides, their order "
                f"alternating; the model kernels on {s.model}")

    def tables(self, results: list[ConfigResult]) -> list[Table]:
        """Both sides and their ratio, with each kernel's own figures; who the sides are; warm-up and noise."""

        def row(result: ConfigResult) -> list[str]:
            speedup, equal = result.p50("speedup"), result.derived.get("outputs_equal")
            return [_ms(result.p50("kernel_ms")) + result.spread_flag, _ms(result.p50("baseline_ms")),
                    f"{speedup:.2f}x" if speedup is not None else "-", _also(result),
                    {True: "yes", False: "NO", None: "-"}[equal]]

        kernels = dict.fromkeys(r.config.kernel for r in results)
        caption = "\n".join(f"{name}: ours = {KERNELS[name].ours}; baseline = {KERNELS[name].baseline}"
                            for name in kernels)
        roofline = roofline_table(results, [("ours", "kernel_"), ("baseline", "baseline_")])
        return [config_table(results, "kernels (medians over the rounds; speed-up: baseline / ours, per round)",
                             ["ours ms", "baseline ms", "speed-up", "also (ours / baseline)", "same output"], row,
                             caption=caption),
                *([roofline] if roofline is not None else []), stability_table(results)]
