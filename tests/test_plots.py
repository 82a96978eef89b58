"""The benchmark plots, read back from the figures (matplotlib Agg) drawn from a synthetic result document: the
stage legend lists only the stages one can see, throughput's axis hugs the batch sizes that ran, and every
figure marks the configs the run flagged disturbed."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from opsd_rollout.bench.plots import (DISTURBED_LEGEND, latency_figure, stages_figure, throughput_figure,  # noqa: E402
                                      write_plots)
from opsd_rollout.bench.report import SCHEMA_VERSION, results_of  # noqa: E402
from opsd_rollout.bench.scenarios import RolloutScenario  # noqa: E402
from opsd_rollout.metrics import label  # noqa: E402

SHAPES = [(1, 1), (1, 4), (4, 4)]  # (batch, samples): effective batch 1, 4 and 16
DISTURBED = 1  # the second config


def iteration(scale: float) -> dict:
    """A rollout's stages in ms: prefill and decode large, post-processing 0.1% of the call (too small to see),
    every attributed phase absent."""
    stages = {"prompt_expansion_ms": 5.0, "prefill_ms": 300.0, "decode_ms": 600.0, "generation_overhead_ms": 94.0,
              "post_processing_ms": 1.0}
    row = {name: value * scale for name, value in stages.items()}
    return {**row, "total_ms": sum(row.values()), "tokens_per_second": 100.0 / scale, "peak_memory_bytes": 2**30}


def document() -> dict:
    results = []
    for index, (batch, samples) in enumerate(SHAPES):
        config = dict(batch_size=batch, samples_per_prompt=samples, prompt_length=128, response_length=32,
                      dtype="fp32", decoding="greedy", zero_stage=0, strategy="static", cache_policy="retain",
                      forward_timing=True)
        results.append({"config": config, "status": "ok",
                        "iterations": [iteration(1 + index + k / 10) for k in range(4)],
                        "interference": {"disturbed": index == DISTURBED, "reasons": []}})
    return {"schema_version": SCHEMA_VERSION, "kind": "rollout", "results": results}


@pytest.fixture()
def results():
    return results_of(document(), RolloutScenario.config_type)


@pytest.fixture()
def close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def legend_texts(figure) -> list[str]:
    return [text.get_text() for legend in figure.legends for text in legend.get_texts()]


def test_the_stage_legend_lists_the_stages_one_can_see_and_the_disturbed_mark(results, close_figures):
    figure = stages_figure(results, RolloutScenario)
    shown = ["prompt_expansion_ms", "prefill_ms", "decode_ms", "generation_overhead_ms"]
    assert legend_texts(figure) == [label(name) for name in shown] + [DISTURBED_LEGEND]
    axes = figure.axes[0]
    assert label("post_processing_ms") in axes.get_xlabel(), "the plot names what it left out"
    assert label("param_gather_ms") not in axes.get_xlabel(), "a stage that never ran is not mentioned"


def test_disturbed_configs_are_starred_and_hatched_in_the_stage_plot(results, close_figures):
    axes = stages_figure(results, RolloutScenario).axes[0]
    ticks = [tick.get_text() for tick in axes.get_xticklabels()]
    assert [t.endswith(" *") for t in ticks] == [i == DISTURBED for i in range(len(SHAPES))]
    for container in axes.containers:
        assert [bool(bar.get_hatch()) for bar in container.patches] == [i == DISTURBED for i in range(len(SHAPES))]


def test_the_latency_plot_marks_the_disturbed_config(results, close_figures):
    figure = latency_figure(results, RolloutScenario)
    axes = figure.axes[0]
    ticks = [tick.get_text() for tick in axes.get_xticklabels()]
    assert [t.endswith(" *") for t in ticks] == [i == DISTURBED for i in range(len(SHAPES))]
    assert [bool(box.get_hatch()) for box in axes.patches] == [i == DISTURBED for i in range(len(SHAPES))]
    assert legend_texts(figure) == [DISTURBED_LEGEND]


def test_no_disturbed_config_no_mark(results, close_figures):
    for result in results:
        result.interference = {"disturbed": False}
    assert DISTURBED_LEGEND not in legend_texts(stages_figure(results, RolloutScenario))
    assert legend_texts(latency_figure(results, RolloutScenario)) == []


def test_throughput_axis_hugs_the_batch_sizes_and_rings_the_disturbed_point(results, close_figures):
    figure = throughput_figure(results, RolloutScenario)
    axes = figure.axes[0]
    low, high = axes.get_xlim()
    assert 1 / 2 <= low < 1 and 16 < high <= 32, "a quarter of an octave each side, no empty half"
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["1", "4", "16"]
    assert DISTURBED_LEGEND in legend_texts(figure)
    rings = [c for c in axes.collections if c.get_label() == DISTURBED_LEGEND]
    expected = [results[DISTURBED].config.effective_batch_size, results[DISTURBED].metric("tokens_per_second").p50]
    assert len(rings) == 1 and len(rings[0].get_offsets()) == 1
    assert rings[0].get_offsets().tolist()[0] == pytest.approx(expected)


def test_write_plots_writes_the_three_figures(results, tmp_path):
    paths = write_plots(results, tmp_path, RolloutScenario)
    assert [p.name for p in paths] == ["stages.png", "latency.png", "throughput.png"]
    assert all(p.stat().st_size > 0 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
