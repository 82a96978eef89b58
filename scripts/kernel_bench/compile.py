"""``compile``: ms per decode token of the compiled decode step (``compile_decode=True``) against the eager one,
and each side's share of the measured copy bandwidth. Per side and round, two unprofiled greedy calls of ``SHORT``
and ``LONG`` new tokens (EOS ignored); their difference over ``LONG - SHORT`` cancels prefill and per-call work,
and no profiling hook breaks the compiled graph. Compiling happens in the config's first (warm-up) round.

``compiled_speed`` is the same measurement over several batch sizes in one call (``scripts/gpu_check.py``)."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from opsd_rollout.bench.facts import decode_bytes_per_step, roofline
from kernel_bench import LONG, SHORT
from kernel_bench.contest import Contest, Timed
from opsd_rollout.bench.timing import timed


def step_roofline(spec: Any, rows: int, prompt_length: int, sides: dict[str, float],
                  ceilings: dict[str, Any] | None) -> dict[str, Any]:
    """For ``sides`` (name -> ms per token): the bytes a step reads (weights + the KV cache at the mean context of
    the differenced tokens), ``decode_bytes_per_step``, and per side ``<side>_bandwidth_bytes_per_s`` and
    ``<side>_bandwidth_utilisation`` (its share of the copy bandwidth in ``ceilings``)."""
    read = decode_bytes_per_step(spec, rows, prompt_length + (SHORT + LONG) / 2)
    out: dict[str, Any] = {"decode_bytes_per_step": read}
    for side, ms in sides.items():
        figures = roofline(read, ms, ceilings)
        out[f"{side}_bandwidth_bytes_per_s"] = figures["decode_bandwidth_bytes_per_s"]
        out[f"{side}_bandwidth_utilisation"] = figures["decode_bandwidth_utilisation"]
    return out


class CompileContest(Contest):
    def __init__(self, model: Any, tokenizer: Any, rows: int, prompt_length: int, device: torch.device, seed: int = 0):
        from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
        from opsd_rollout.bench.prompts import synthetic_prompts
        from opsd_rollout.bench.workload import WorkloadRollout

        super().__init__(device)
        self.request = synthetic_prompts(rows, prompt_length, vocab_size=model.config.vocab_size, seed=seed,
                                         device=device)
        self.sampling = {r: SamplingConfig(max_new_tokens=r, temperature=0) for r in (SHORT, LONG)}
        self.compiled, self.eager = (  # EOS ignored (fixed length): no EOS ids needed
            WorkloadRollout(HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(compile_decode=on, seed=0)),
                            "fixed", ())
            for on in (True, False))

    def _per_token(self, rollout: Any) -> tuple[float, torch.Tensor]:
        """(ms per decode token, the long call's tokens)."""
        short, _ = timed(lambda: rollout.generate(self.request, self.sampling[SHORT]), self.device)
        long, batch = timed(lambda: rollout.generate(self.request, self.sampling[LONG]), self.device)
        return (long - short) / (LONG - SHORT), batch.input_ids

    def ours(self) -> tuple[float, torch.Tensor]:
        return self._per_token(self.compiled)

    def baseline(self) -> tuple[float, torch.Tensor]:
        return self._per_token(self.eager)

    def figures(self, sides: dict[str, Timed]) -> dict[str, Any]:
        return {"kernel_ms": sides["ours"].result[0], "baseline_ms": sides["baseline"].result[0]}

    def same(self, ours: Any, baseline: Any) -> bool:
        return torch.equal(ours[1], baseline[1])


def build(config: Any, settings: Any, built: Any, device: torch.device) -> CompileContest:
    return CompileContest(built.engine, built.tokenizer, config.rows, config.prompt_length, device, settings.seed)


def compiled_speed(model: Any, tokenizer: Any, batch_sizes: list[int], prompt_length: int, rounds: int,
                   device: torch.device) -> list[dict[str, Any]]:
    """Per batch size, after one unrecorded round (it compiles): the medians over ``rounds`` rounds of eager and
    compiled ms per token, the speed-up, whether every round's tokens were equal, the bytes a step reads and each
    side's achieved bandwidth and share of the roofline (the copy bandwidth measured once, here)."""
    from opsd_rollout.bench.environment import measure_ceilings
    from opsd_rollout.modeling import ModelSpec

    spec = ModelSpec.of(model)
    ceilings = measure_ceilings(device)
    out = []
    for batch in batch_sizes:
        contest = CompileContest(model, tokenizer, batch, prompt_length, device)
        contest.run()
        figures = [contest.run() for _ in range(rounds)]
        compiled = statistics.median(f["kernel_ms"] for f in figures)
        eager = statistics.median(f["baseline_ms"] for f in figures)
        out.append({"batch_size": batch, "eager_ms_per_token": eager, "compiled_ms_per_token": compiled,
                    "speedup": eager / compiled, "equal_tokens": all(f["outputs_equal"] for f in figures),
                    "copy_bandwidth_bytes_per_s": ceilings["memory_bandwidth_bytes_per_s"],
                    **step_roofline(spec, batch, prompt_length, {"eager": eager, "compiled": compiled}, ceilings)})
    return out
