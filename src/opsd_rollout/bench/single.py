"""One profiled rollout on one model, printed as a table (``opsd-rollout bench``)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutProfile, SamplingConfig
from opsd_rollout.bench.prompts import synthetic_prompts
from opsd_rollout.models import DEFAULT_MODEL, load_model


@dataclass(kw_only=True)
class SingleRolloutSpec:
    model: str = DEFAULT_MODEL
    batch_size: int = 4
    samples_per_prompt: int = 4
    prompt_length: int = 128
    max_new_tokens: int = 32
    warmup: int = 1
    seed: int = 0


def profile_table(profile: RolloutProfile, title: str) -> Table:
    table = Table(title=title)
    table.add_column("stage")
    table.add_column("ms", justify="right")
    table.add_column("share", justify="right")
    rows = [("prompt expansion", profile.prompt_expansion_ms), ("generation", profile.generation_ms),
            ("  prefill", profile.prefill_ms), (f"  decode ({profile.decode_steps} steps)", profile.decode_ms),
            ("  other generation work", profile.generation_overhead_ms),
            ("post-processing", profile.post_processing_ms), ("  attention mask", profile.attention_mask_ms),
            ("total", profile.total_ms)]
    for name, ms in rows:
        table.add_row(name, f"{ms:.2f}", f"{100 * ms / profile.total_ms:.1f}%" if profile.total_ms else "-")
    table.caption = (f"{profile.generated_tokens} generated tokens, {profile.tokens_per_second:.0f} tok/s, "
                     f"decode {profile.decode_tokens_per_second:.0f} tok/s, peak memory "
                     f"{profile.peak_memory_bytes / 2**20:.0f} MiB ({profile.peak_memory_source})")
    return table


def run_single(spec: SingleRolloutSpec, console: Console) -> RolloutProfile:
    model, tokenizer = load_model(spec.model)
    rollout = HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
    request = synthetic_prompts(spec.batch_size, spec.prompt_length, vocab_size=model.config.vocab_size,
                                seed=spec.seed)
    sampling = SamplingConfig(max_new_tokens=spec.max_new_tokens, n_samples_per_prompt=spec.samples_per_prompt,
                              temperature=0.0)
    for _ in range(spec.warmup):
        rollout.generate(request, sampling)
    rollout.generate(request, sampling)
    profile = rollout.get_last_profile()
    console.print(profile_table(profile, f"{spec.model}: B={spec.batch_size} n={spec.samples_per_prompt} "
                                         f"prompt={spec.prompt_length} max_new_tokens={spec.max_new_tokens}"))
    return profile
