"""The bench derives the engine's axes from the engine's config (issue 34, part 5): one axis per field of
``HybridEngineRolloutConfig`` and its ``RolloutOptions`` (flag, parser, default, key fragment and help from the
field), so a new engine option is an axis with no bench edit; keys of every committed result are unchanged, and
``compare``'s reader reads every committed result."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path

import pytest

from kernel_bench.scenario import KernelsScenario
from opsd_rollout.bench.axes import NOT_AXES, ROLLOUT_AXES, SPELLINGS, engine_axes
from opsd_rollout.bench.matrix import Matrix
from opsd_rollout.bench.report import load_document, results_of
from opsd_rollout.bench.scenarios import SCENARIOS, RolloutScenario
from opsd_rollout.cli import main
from opsd_rollout.rollout import HybridEngineRolloutConfig
from opsd_rollout.rollout.config import RolloutOptions

COMMITTED = sorted(path for path in Path(__file__).parents[1].joinpath("benchmarks").rglob("*.json")
                   if "schema_version" in json.loads(path.read_text()))
"""Every result file under benchmarks/ (its traces are JSON too, and no result)."""
KINDS = {**SCENARIOS, KernelsScenario.kind: KernelsScenario}
"""The package's scenarios and the developers' kernels (``scripts/kernel_bench``), which wrote the others."""


def axis_fields(config_type) -> list[str]:
    """Every field of the config and of the dataclasses it nests, but those the bench says are no axis."""
    out = []
    for f in fields(config_type):
        if f.name in NOT_AXES:
            continue
        nested = f.default_factory if f.default_factory is not MISSING else None
        out += axis_fields(nested) if nested is not None and is_dataclass(nested) else [f.name]
    return out


def test_the_engine_axes_are_the_engine_configs_fields():
    engine = [axis.engine for axis in ROLLOUT_AXES if axis.engine]
    assert engine == axis_fields(HybridEngineRolloutConfig)
    assert {"enable_profiling", "strategy", "seed"}.isdisjoint(engine)  # the bench's own, or the contenders axis
    for axis in ROLLOUT_AXES:
        if axis.engine:  # the default is the engine's, and the matrix's when the axis is not given
            owner = RolloutOptions() if axis.engine in {f.name for f in fields(RolloutOptions)} else \
                HybridEngineRolloutConfig()
            assert axis.default == getattr(owner, axis.engine) == RolloutScenario.defaults[axis.name][0]


def test_the_engines_config_knows_no_bench_and_the_bench_spells_only_its_fields():
    """The axes' names, key fragments and strategies live in the bench (``SPELLINGS``, ``NOT_AXES``); an entry for a
    field the engine no longer has would silently stop spelling it (and change committed keys)."""
    engine = HybridEngineRolloutConfig()
    assert not any(f.metadata for config in (engine, engine.options) for f in fields(config))
    names = {f.name for config in (engine, engine.options) for f in fields(config)}
    assert set(SPELLINGS) <= names and set(NOT_AXES) <= names
    assert set(SPELLINGS).isdisjoint(NOT_AXES)


@dataclass(kw_only=True)
class DraftOptions(RolloutOptions):
    draft_budget_bytes: int | None = None
    """Most bytes the draft model's cache may take. More words that are not the help."""


@dataclass(kw_only=True)
class DraftConfig(HybridEngineRolloutConfig):
    draft_tokens: int = 4
    """Speculative decoding: draft tokens proposed per step. Not part of the help."""
    draft_sampling: str = "greedy"
    options: DraftOptions = field(default_factory=DraftOptions)


def test_a_new_engine_option_becomes_an_axis_with_no_bench_edit():
    axes = {axis.name: axis for axis in engine_axes(DraftConfig)}
    assert [a.engine for a in axes.values()] == axis_fields(DraftConfig)
    tokens, budget = axes["draft_tokens"], axes["draft_budget_bytes"]
    assert tokens.flag == "--draft-tokens" and tokens.default == 4 and tokens.parse("8") == 8
    assert tokens.help.startswith("Speculative decoding: draft tokens proposed per step (draft_tokens; static")
    assert tokens.fragment(4) == "" and tokens.fragment(8) == "draft_tokens=8"  # old keys stay, new ones say it
    assert budget.parse("none") is None and budget.parse("64MiB") == 64 * 2**20 and budget.fragment(2**20) == \
        "draft_budget_bytes=1MiB"
    assert budget.help.startswith("Most bytes the draft model's cache may take (options.draft_budget_bytes")
    with pytest.raises(ValueError):
        tokens.parse("0")
    assert axes["draft_sampling"].parse("beam") == "beam"  # a text field without choices takes any text


def test_every_committed_result_reads_as_compare_reads_it_with_its_keys():
    assert COMMITTED, "benchmarks/ holds result files"
    for path in COMMITTED:
        document = load_document(str(path))
        scenario = KINDS[document["kind"]]
        Matrix.parse(scenario, document["matrix"])  # --resume-results reads it the same way
        stored = [r["key"] for r in json.loads(path.read_text())["results"]]
        assert [r.config.key for r in results_of(document, scenario.config_type)] == stored, path


@pytest.mark.parametrize("path", COMMITTED[:1] + [p for p in COMMITTED if "contenders" in str(p)][:1]
                         + [p for p in COMMITTED if p.parent.name == "kernels"][:1], ids=lambda p: p.name)
def test_compare_reads_a_committed_result_against_itself(path, capsys):
    assert main(["compare", str(path), str(path), "--allow-disturbed", "--allow-partial"]) in (0, 3)
    assert "Traceback" not in capsys.readouterr().err


def test_compare_reads_every_committed_kernels_result_from_the_document_alone():
    """The kernels' scenario is not in the package: ``compare`` matches their configs by the keys the files hold."""
    from opsd_rollout.bench.compare import compare_documents

    kernels = [path for path in COMMITTED if json.loads(path.read_text())["kind"] == "kernels"]
    assert len(kernels) >= 8, "benchmarks/kernels/ and benchmarks/perf/kernels.json hold kernels results"
    for path in kernels:
        document = load_document(str(path))
        comparison = compare_documents(document, document, allow_disturbed=True)
        ok = [r for r in document["results"] if r["status"] == "ok"]
        assert comparison.matched == len(ok) and not comparison.regressions, path
        assert {c.key for c in comparison.changes} == {r["key"] for r in ok}, path


def test_every_engine_axis_reaches_the_engines_config():
    """A value off the default on any engine axis is that field's value in the config our contender builds."""
    base = {"batch_size": 1, "samples_per_prompt": 1, "prompt_length": 8, "response_length": 4}
    for axis in (axis for axis in ROLLOUT_AXES if axis.engine):
        value = next(parsed for text in ("on", "off", "3", "64MiB", "release", "per_layer", "longest")
                     if (parsed := _parsed(axis, text)) is not None and parsed != axis.default)
        config = RolloutScenario.make_config(**{**{a.field: a.default for a in ROLLOUT_AXES}, **base,
                                                axis.field: value})
        built = HybridEngineRolloutConfig.from_flat(**config.engine_fields)
        where = built.options if axis.engine in {f.name for f in fields(RolloutOptions)} else built
        assert getattr(where, axis.engine) == value, axis.name
        assert axis.fragment(value) in config.key.split("-"), axis.name  # and the key says so


def _parsed(axis, text):
    try:
        return axis.parse(text)
    except (ValueError, TypeError):
        return None
