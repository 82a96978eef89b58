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
        from opsd_rollout.profiling.profile import RolloutProfile  # torch: only when plotting rollouts

        rows = [RolloutProfile(**it) for it in rows]
    return {stage: median((row[stage] or 0.0) if stage in row else 0.0 for row in rows) for stage in stages}


def write_plots(results: list[ConfigResult], directory: str | Path, scenario: Any) -> list[Path]:
    """Writes stages.png, latency.png and (when the effective batch size varies) throughput.png for the
    configs that ran; returns their paths. ``scenario`` says which stages stack and what one iteration is."""
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.status == "ok"]
    names = display_labels([r.config for r in ok])
    labels = [names[r.config.key] for r in ok]
    paths = [_stages(plt, ok, labels, scenario, directory / "stages.png"),
             _latency(plt, ok, labels, scenario, directory / "latency.png")]
    if len({r.config.effective_batch_size for r in ok}) > 1:  # a line needs more than one batch size
        paths.append(_throughput(plt, ok, scenario, directory / "throughput.png"))
    return paths


def _stages(plt, ok: list[ConfigResult], labels: list[str], scenario: Any, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(ok) + 3), 4.5))
    bottoms = [0.0] * len(ok)
    medians = [_median_stage_ms(r, scenario.stages) for r in ok]
    for stage in scenario.stages:
        heights = [m[stage] for m in medians]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, label=label(stage))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("ms (median iteration per stage)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Where {scenario.what} time goes")
    _legend_outside(ax)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    return _save(fig, path, plt)


def _latency(plt, ok: list[ConfigResult], labels: list[str], scenario: Any, path: Path) -> Path:
    """Each config's iterations as a box (median, quartiles, whiskers at 1.5 IQR) with every iteration drawn
    as a dot; a log axis when the values span more than 5x, so one slow config or iteration does not flatten
    the others."""
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(ok) + 2), 4.5))
    values = [list(r.metric("total_ms").values) for r in ok]
    ax.boxplot(values, showfliers=False, widths=0.5)
    for position, points in enumerate(values, start=1):
        ax.plot([position] * len(points), points, "o", markersize=3, alpha=0.5, color="black")
    every = [v for points in values for v in points]
    if every and min(every) > 0 and max(every) / min(every) > 5:
        ax.set_yscale("log")
    ax.set_xticks(range(1, len(ok) + 1), labels, rotation=30, fontsize=8)
    ax.set_ylabel(f"{scenario.what} latency (ms), every iteration")
    ax.set_title("Latency per config")
    return _save(fig, path, plt)


def _throughput(plt, ok: list[ConfigResult], scenario: Any, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
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
    _legend_outside(ax)
    return _save(fig, path, plt)


def _legend_outside(ax) -> None:
    """Beside the axes, never over the data."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


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
