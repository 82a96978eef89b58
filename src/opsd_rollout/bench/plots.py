"""PNG plots of a benchmark run: stacked stage breakdown, p50/p95 latency, tokens/s against effective batch.
What is stacked and how it is labelled come from the scenario and the metric registry.

Each figure is built by a function that returns it (tests read its legend and marks), and ``write_plots`` saves
them. A config the run flagged *disturbed* (its interference record: other processes or the hypervisor took CPU
time during its iterations) is marked on every figure, hatched and with ``*`` after its label, since its numbers
say more about the machine than about the code.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from opsd_rollout.bench.report import ConfigResult
from opsd_rollout.files import save_figure_atomic
from opsd_rollout.bench.tables import display_labels
from opsd_rollout.bench.stats import median
from opsd_rollout.metrics import label

VISIBLE_SHARE = 0.005
"""A stage under this share of every config's bar is left out of the stages plot and its legend: it would be a
hairline no one can read (the rollout table leaves out columns under 0.5% alike); the plot names what it left out."""
DISTURBED_MARK = " *"
DISTURBED_HATCH = "//"
DISTURBED_LEGEND = "* disturbed: rerun on a quiet machine"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'opsd-rollout[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: list[ConfigResult], directory: str | Path, scenario: Any) -> list[Path]:
    """Writes stages.png, latency.png and (when the effective batch size varies) throughput.png for the
    configs that ran; returns their paths. ``scenario`` says which stages stack and what one iteration is."""
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.status == "ok"]
    figures = {"stages.png": stages_figure(ok, scenario), "latency.png": latency_figure(ok, scenario)}
    if len({r.config.effective_batch_size for r in ok}) > 1:  # a line needs more than one batch size
        figures["throughput.png"] = throughput_figure(ok, scenario)
    return [_save(figure, directory / name, plt) for name, figure in figures.items()]


def tick_labels(results: list[ConfigResult]) -> list[str]:
    """Each config's short label, with ``*`` after a disturbed one's."""
    names = display_labels([r.config for r in results])
    return [names[r.config.key] + (DISTURBED_MARK if r.disturbed else "") for r in results]


def _stage_ms(row: dict[str, Any], stage: str) -> float:
    if stage in row:
        return row[stage] or 0.0
    if stage == "generation_overhead_ms":  # derived: records written before to_dict() carried it lack it
        from opsd_rollout.bench.reference import without_reference  # torch: only when plotting such rollouts
        from opsd_rollout.profiling.profile import RolloutProfile

        return RolloutProfile(**without_reference(row)).generation_overhead_ms
    return 0.0


def median_stage_ms(result: ConfigResult, stages: tuple[str, ...]) -> dict[str, float]:
    """Per stage, its median over the iterations."""
    return {stage: median(_stage_ms(row, stage) for row in result.iterations) for stage in stages}


def visible_stages(medians: list[dict[str, float]], stages: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The stages worth a bar segment (at least ``VISIBLE_SHARE`` of some config's bar), and those that took some
    time but too little to see (a stage that never ran is neither)."""
    totals = [sum(m.values()) for m in medians]
    shown = [s for s in stages if any(t > 0 and m[s] / t >= VISIBLE_SHARE for m, t in zip(medians, totals))]
    return shown, [s for s in stages if s not in shown and any(m[s] > 0 for m in medians)]


def stages_figure(ok: list[ConfigResult], scenario: Any):
    fig, ax = _pyplot().subplots(figsize=(max(6, 1.1 * len(ok) + 3), 4.5), layout="constrained")
    labels = tick_labels(ok)
    medians = [median_stage_ms(r, scenario.stages) for r in ok]
    shown, hidden = visible_stages(medians, scenario.stages)
    bottoms = [0.0] * len(ok)
    for stage in shown:
        heights = [m[stage] for m in medians]
        bars = ax.bar(labels, heights, bottom=bottoms, label=label(stage))
        _hatch_disturbed(bars.patches, ok)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("ms (median iteration per stage)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Where {scenario.what} time goes")
    if hidden:
        note = f"not drawn (under {100 * VISIBLE_SHARE:g}% of every bar): {', '.join(map(label, hidden))}"
        ax.set_xlabel("\n".join(textwrap.wrap(note, 70)), fontsize=8)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    handles, _ = ax.get_legend_handles_labels()
    _legend(fig, handles + _disturbed_handles(ok), "outside right upper")
    return fig


def latency_figure(ok: list[ConfigResult], scenario: Any):
    """Each config's iterations as a box (median, quartiles, whiskers at 1.5 IQR) with every iteration drawn
    as a dot; a log axis when the values span more than a factor of 5, so one slow config or iteration does not
    flatten the others."""
    fig, ax = _pyplot().subplots(figsize=(max(6, 1.1 * len(ok) + 2), 4.5), layout="constrained")
    values = [list(r.metric("total_ms").values) for r in ok]
    boxes = ax.boxplot(values, showfliers=False, widths=0.5, patch_artist=True,
                       boxprops={"facecolor": "white"}, medianprops={"color": "C1"})
    _hatch_disturbed(boxes["boxes"], ok)
    for position, points in enumerate(values, start=1):
        ax.plot([position] * len(points), points, "o", markersize=3, alpha=0.5, color="black")
    every = [v for points in values for v in points]
    if every and min(every) > 0 and max(every) / min(every) > 5:
        ax.set_yscale("log")
    ax.set_xticks(range(1, len(ok) + 1), tick_labels(ok), rotation=30, fontsize=8)
    ax.set_ylabel(f"{scenario.what} latency (ms), every iteration")
    ax.set_title("Latency per config")
    if any(r.disturbed for r in ok):
        _legend(fig, _disturbed_handles(ok), "outside lower center")
    return fig


def throughput_figure(ok: list[ConfigResult], scenario: Any):
    """One line per series against the effective batch size, on a log axis with a tick at each batch size run
    and limits that hug them; the legend under the axes, so the lines get the figure's width."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5), layout="constrained")
    # one line per prompt length (and per value of any other axis that varies, samples per prompt
    # included), so no two points of a line share an effective batch size
    series: dict[str, list[tuple[int, float, bool]]] = defaultdict(list)
    for result in ok:
        series[_series_name(result, ok)].append((result.config.effective_batch_size,
                                                 result.metric("tokens_per_second").p50, result.disturbed))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    disturbed = [p for points in series.values() for p in points if p[2]]
    if disturbed:
        ax.scatter([p[0] for p in disturbed], [p[1] for p in disturbed], s=160, facecolors="none",
                   edgecolors="black", zorder=3, label=DISTURBED_LEGEND)  # a ring round each disturbed point
    _fit_batch_axis(ax, sorted({r.config.effective_batch_size for r in ok}))
    ax.set_xlabel("effective batch size (batch x samples per prompt)")
    ax.set_ylabel(scenario.throughput_label)
    ax.set_title("Throughput against effective batch")
    handles, _ = ax.get_legend_handles_labels()
    _legend(fig, handles, "outside lower center", columns=2 if len(series) > 3 else 1)
    return fig


def _fit_batch_axis(ax, sizes: list[int]) -> None:
    """Log base 2, ticks at the sizes that ran (plain numbers), a quarter of an octave of margin each side."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlim(sizes[0] / 2 ** 0.25, sizes[-1] * 2 ** 0.25)


def _hatch_disturbed(patches, ok: list[ConfigResult]) -> None:
    for patch, result in zip(patches, ok):
        if result.disturbed:
            patch.set_hatch(DISTURBED_HATCH)
            patch.set_edgecolor("black")


def _disturbed_handles(ok: list[ConfigResult]) -> list[Any]:
    """The legend entry that explains the disturbed marks, when a config has them."""
    from matplotlib.patches import Patch

    if not any(r.disturbed for r in ok):
        return []
    return [Patch(facecolor="white", edgecolor="black", hatch=DISTURBED_HATCH, label=DISTURBED_LEGEND)]


def _legend(fig, handles: list[Any], where: str, columns: int = 1) -> None:
    """Outside the axes (``outside right upper``, ``outside lower center``), never over the data: the
    constrained layout makes room for it, so the axes keep the rest of the figure."""
    fig.legend(handles=handles, loc=where, fontsize=8, ncols=columns)


def _series_name(result: ConfigResult, results: list[ConfigResult]) -> str:
    config = asdict(result.config)
    varying = [axis for axis in config if axis != "batch_size" and axis != "prompt_length"
               and len({str(asdict(r.config)[axis]) for r in results}) > 1]
    return " ".join([f"prompt {result.config.prompt_length}"] + [f"{axis}={config[axis]}" for axis in varying])


def _save(fig, path: Path, plt) -> Path:
    """Cropped to what is drawn (``bbox_inches="tight"``: no empty margin), written atomically."""
    save_figure_atomic(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
