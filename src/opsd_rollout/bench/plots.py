"""PNG plots of a benchmark run: stacked stage breakdown, tokens/s against effective batch, p50/p95 latency.
What is stacked and how it is labelled come from the scenario and the metric registry."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from opsd_rollout.bench.report import ConfigResult, display_labels
from opsd_rollout.bench.stats import median
from opsd_rollout.metrics import label
from opsd_rollout.profiling import RolloutProfile


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'opsd-rollout[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _median_stage_ms(result: ConfigResult, stages: tuple[str, ...]) -> dict[str, float]:
    """Per stage, its median over the iterations (a rollout's ``generation_overhead_ms`` is derived, not stored,
    so rollout iterations are read through their profile)."""
    rows: list[Any] = result.iterations
    if rows and "generation_overhead_ms" in stages:
        rows = [RolloutProfile(**it) for it in rows]
    return {stage: median((row[stage] or 0.0) if stage in row else 0.0 for row in rows) for stage in stages}


def write_plots(results: list[ConfigResult], directory: str | Path, scenario: Any) -> list[Path]:
    """Writes stages.png, throughput.png and latency.png for the configs that ran; returns their paths.
    ``scenario`` says which stages stack (a rollout's or an OPSD step's) and what one iteration is."""
    stages = scenario.stages
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.status == "ok"]
    names = display_labels([r.config for r in ok])
    labels = [names[r.config.key] for r in ok]
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(ok) + 2), 4.5))
    bottoms = [0.0] * len(ok)
    medians = [_median_stage_ms(r, stages) for r in ok]
    for stage in stages:
        heights = [m[stage] for m in medians]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, label=label(stage))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("ms (median iteration per stage)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Where {scenario.what} time goes")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    paths.append(_save(fig, directory / "stages.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    # one line per prompt length (and per value of any other axis that varies, samples per prompt
    # included), so no two points of a line share an effective batch size
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for result in ok:
        series[_series_name(result, ok)].append((result.config.effective_batch_size,
                                                 result.metric("tokens_per_second").p50))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("effective batch size (batch x samples per prompt)")
    ax.set_ylabel(scenario.throughput_label)
    ax.set_title("Throughput against effective batch")
    ax.legend(fontsize=8)
    paths.append(_save(fig, directory / "throughput.png", plt))

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(ok) + 2), 4.5))
    p50 = [r.metric("total_ms").p50 for r in ok]
    p95 = [r.metric("total_ms").p95 for r in ok]
    positions = range(len(ok))
    ax.bar([i - 0.2 for i in positions], p50, width=0.4, label="p50")
    ax.bar([i + 0.2 for i in positions], p95, width=0.4, label="p95")
    ax.set_xticks(list(positions), labels, rotation=30, fontsize=8)
    ax.set_ylabel(f"{scenario.what} latency (ms)")
    ax.set_title("Latency per config")
    ax.legend(fontsize=8)
    paths.append(_save(fig, directory / "latency.png", plt))
    return paths


def _series_name(result: ConfigResult, results: list[ConfigResult]) -> str:
    config = asdict(result.config)
    varying = [axis for axis in config if axis != "batch_size" and axis != "prompt_length"
               and len({str(asdict(r.config)[axis]) for r in results}) > 1]
    return " ".join([f"prompt {result.config.prompt_length}"] + [f"{axis}={config[axis]}" for axis in varying])


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
