"""The documentation checked against the code it describes: the README's length, every relative link, the table of
DeepSpeed's config fields (built here from DeepSpeed's dataclasses and what ``from_any`` does with each field), the
config fields and versions the README names, the training record's keys (docs/TRAINING.md, from
``metrics.TRAINING``), and the README's and PROFILING.md's examples run as written.

``python tests/test_docs.py`` prints the DeepSpeed field table as docs/MIGRATING.md must hold it;
``python tests/test_docs.py training`` prints docs/TRAINING.md's table of the training record's keys.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_WORD_LIMIT = 2000
"""Two screens (STYLE.md rule 11), counted as ``wc -w`` counts."""


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def table_rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with ``header``, as stripped cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


# ---- length and links ---------------------------------------------------------------------------------------------

def test_the_readme_fits_on_two_screens():
    words = len(README.read_text().split())
    assert words <= README_WORD_LIMIT, f"README.md has {words} words; details belong in docs/"


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation but ``-`` dropped, spaces as ``-``."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file_of_the_repository(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_file(), f"{page.name}: link {target!r} points to no file"
        assert ROOT in resolved.parents, f"{page.name}: link {target!r} leaves the repository"
        if anchor:
            assert anchor in heading_anchors(resolved), f"{page.name}: {target!r}: no such heading"


# ---- DeepSpeed's config fields ------------------------------------------------------------------------------------

def _deepspeed_configs():
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig as DeepSpeedRolloutConfig

    from opsd_rollout import RolloutConfig, SamplingConfig

    return DeepSpeedRolloutConfig, RolloutConfig, SamplingConfig


def _what_from_any_sets(cfg) -> dict:
    """The fields of ours ``HybridEngineRolloutConfig.from_any(cfg)`` sets: the keywords it builds our config with
    (from_any run on a subclass that records them, so a value equal to our default still shows, where a diff of
    built configs would not), DeepSpeed's own names replaced by the fields of ours they set."""
    from opsd_rollout import HybridEngineRolloutConfig
    from opsd_rollout.rollout.deepspeed_fields import NAMES, implied_fields

    class Recorded(HybridEngineRolloutConfig):
        def __init__(self, **values):  # noqa: D401 - records instead of building
            self.values = values

    values = HybridEngineRolloutConfig.from_any.__func__(Recorded, cfg).values
    deepspeed = {name: values.pop(name) for name in NAMES if name in values}
    return {**values, **implied_fields(deepspeed, values)}


def _probe(field: dataclasses.Field):
    """A value of the field other than its default: the one the table shows being mapped."""
    if isinstance(field.default, bool):
        return not field.default
    if field.default is None:
        return 4096
    return f"not-{field.default}"


def _literal(value) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _code(value) -> str:
    return f"`{_literal(value)}`"


def _ours(changed: dict) -> str:
    """``name=value`` per field set, saying where the value is our default anyway."""
    from opsd_rollout import HybridEngineRolloutConfig

    defaults = {f.name: f.default for f in dataclasses.fields(HybridEngineRolloutConfig)}
    return ", ".join(f"`{name}={_literal(value)}`" + (" (our default)" if defaults.get(name) == value else "")
                     for name, value in changed.items()) or "nothing"


def deepspeed_field_rows() -> list[list[str]]:
    """[field, DeepSpeed's default, the value tried, what ``from_any`` then sets in ours] for every field of
    DeepSpeed's ``HybridEngineRolloutConfig`` and ``RolloutConfig``; ``SamplingConfig`` is DeepSpeed's own class
    here, so its fields are read as they are."""
    import opsd_rollout

    hybrid, rollout_config, sampling = _deepspeed_configs()
    rows = []
    for cls in (hybrid, rollout_config):
        base = _what_from_any_sets(cls())
        for field in dataclasses.fields(cls):
            value = _probe(field)
            changed = {k: v for k, v in _what_from_any_sets(cls(**{field.name: value})).items() if base.get(k) != v}
            rows.append([f"`{cls.__name__}.{field.name}`", _code(field.default), _code(value), _ours(changed)])
    assert opsd_rollout.SamplingConfig is sampling
    for field in dataclasses.fields(sampling):
        default = "(required)" if field.default is dataclasses.MISSING else _code(field.default)
        rows.append([f"`SamplingConfig.{field.name}`", default, "any", "read by `generate` as it is (the same class)"])
    return rows


FIELD_TABLE_HEADER = "| DeepSpeed field | default | given | our config, from `from_any` |"


def deepspeed_field_table() -> str:
    rows = ["|".join(["", *[f" {cell} " for cell in row], ""]).strip() for row in deepspeed_field_rows()]
    return "\n".join([FIELD_TABLE_HEADER, "|---|---|---|---|", *rows])


def test_the_deepspeed_field_table_is_built_from_the_code():
    migrating = (ROOT / "docs" / "MIGRATING.md").read_text()
    assert table_rows(migrating, FIELD_TABLE_HEADER) == deepspeed_field_rows(), (
        "docs/MIGRATING.md's field table is stale: `python tests/test_docs.py` prints the current one")


# ---- the training record's keys ------------------------------------------------------------------------------------

TRAINING_TABLE_HEADER = "| key (`metrics.jsonl`) | monitor name | unit | across ranks | better | what |"


def training_key_rows() -> list[list[str]]:
    """[key, monitor name, unit, merge rule, which way is better, meaning] for every key of ``metrics.TRAINING``."""
    from opsd_rollout.metrics import TRAINING

    better = {True: "lower", False: "higher", None: "-"}
    return [[f"`{m.name}`", f"`{m.monitor}`" if m.monitor else "-", m.unit or "-",
             "-" if m.unit in ("text", "bool") else m.merge, better[m.lower_is_better], m.meaning]
            for m in TRAINING.values()]


def markdown_table(header: str, rows: list[list[str]]) -> str:
    columns = header.count("|") - 1
    return "\n".join([header, "|" + "---|" * columns, *("| " + " | ".join(row) + " |" for row in rows)])


def test_the_training_key_table_is_built_from_the_registry():
    training = (ROOT / "docs" / "TRAINING.md").read_text()
    assert table_rows(training, TRAINING_TABLE_HEADER) == training_key_rows(), (
        "docs/TRAINING.md's key table is stale: `python tests/test_docs.py training` prints the current one")


# ---- what the README names ------------------------------------------------------------------------------------------

def test_every_top_level_config_field_is_in_the_readmes_table_with_its_default():
    from opsd_rollout import HybridEngineRolloutConfig, RolloutOptions

    rows = {row[0]: row[1] for row in table_rows(README.read_text(), "| field | default |")}
    for field in dataclasses.fields(HybridEngineRolloutConfig):
        assert f"`{field.name}`" in rows, f"the README's config table lacks {field.name}"
        if field.default is not dataclasses.MISSING:
            assert rows[f"`{field.name}`"] == _code(field.default), field.name
    assert set(rows) == {f"`{f.name}`" for f in dataclasses.fields(HybridEngineRolloutConfig)}
    for field in dataclasses.fields(RolloutOptions):
        assert f"`{field.name}`" in README.read_text(), f"the README does not name options.{field.name}"


def test_the_readmes_floor_versions_are_what_make_test_floor_installs():
    pins = dict(line.split("==") for line in (ROOT / "requirements" / "floor.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    rows = {row[0]: row[1] for row in table_rows(README.read_text(), "| | `make test-floor`")}
    floor_python = re.search(r"python(3\.\d+) -c", (ROOT / "Makefile").read_text()).group(1)
    assert f"`make test-floor` runs on Python {floor_python}" in README.read_text()
    for name, version in pins.items():
        assert rows[name] == version, f"{name}: README says {rows.get(name)}, requirements/floor.txt pins {version}"
    assert set(rows) == set(pins)
    declared = re.search(r'requires-python = ">=(3\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"Python {declared}" in README.read_text(), "the README states the oldest Python pyproject.toml allows"


def test_every_preset_is_in_docs_models():
    from opsd_rollout.models import PRESETS

    text = (ROOT / "docs" / "MODELS.md").read_text()
    names = set(re.findall(r"`([\w.|-]+)`", text))
    spelled = {f"{arch}-{size}" for arch in ("llama", "qwen2", "gpt2") for size in ("tiny", "small")
               if "llama|qwen2|gpt2" in names and "tiny|small" in names}
    assert set(PRESETS) <= names | spelled


SPEED_UP = re.compile(r"\b\d+(?:\.\d+)?x\b")


def test_speed_ups_appear_once_in_the_results_table():
    """STYLE rule 11: figures live in one results table with their commands (docs/BENCHMARKS.md's), not in prose
    that goes stale; docs/ARCHITECTURE.md is about the code's layout and is not checked here."""
    pages = [README, *(p for p in DOCS if p.name not in ("BENCHMARKS.md", "ARCHITECTURE.md"))]
    for page in pages:
        found = SPEED_UP.findall(page.read_text())
        assert not found, f"{page.name} states speed-ups {found}: they belong in docs/BENCHMARKS.md's results table"
    benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    prose = benchmarks[:benchmarks.index("## Results")]
    assert not SPEED_UP.findall(prose), "docs/BENCHMARKS.md states speed-ups outside its results table"


# ---- the examples run as written ----------------------------------------------------------------------------------

def example(text: str, needle: str) -> str:
    blocks = [b for b in fenced_blocks(text, "python") if needle in b]
    assert len(blocks) == 1, f"expected one python block with {needle!r}"
    return blocks[0]


def test_the_readmes_rollout_example_runs_and_logs_a_json_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = example(README.read_text(), "to_dict()")
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    records = [json.loads(line) for line in (tmp_path / "profiles.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["num_generated_tokens"] == records[0]["generated_tokens"] > 0


def test_profilings_example_logs_json_lines_and_tensorboard_scalars(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    code = example((ROOT / "docs" / "PROFILING.md").read_text(), "SummaryWriter")
    exec(compile(code, "PROFILING.md", "exec"), {"__name__": "profiling"})
    records = [json.loads(line) for line in (tmp_path / "profiles.jsonl").read_text().splitlines()]
    assert len(records) == 3
    events = EventAccumulator(str(tmp_path / "runs" / "profiles"))
    events.Reload()
    assert [e.value for e in events.Scalars("rollout/total_ms")] == pytest.approx([r["total_ms"] for r in records])


def test_trainings_python_example_is_the_flags_it_names(monkeypatch):
    """docs/TRAINING.md's library call builds the config its flags would (as it says they map), without training."""
    import opsd_rollout.train
    from opsd_rollout.train import TrainConfig

    seen = []
    monkeypatch.setattr(opsd_rollout.train, "train", seen.append)
    exec(compile(example((ROOT / "docs" / "TRAINING.md").read_text(), "TrainConfig("), "TRAINING.md", "exec"),
         {"__name__": "training"})
    assert seen == [TrainConfig.from_flat(dict(
        output_dir="runs/student", student="llama-tiny", teacher="runs/teacher/model", steps=200, max_new_tokens=32,
        samples_per_prompt=4, top_k=0, loss="sampled_reverse_kl", estimator="k3", teacher_cache="sampled", lr=3e-3,
        zero_stage=2))]


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["training"]:  # docs/TRAINING.md's table of the training record's keys
        print(markdown_table(TRAINING_TABLE_HEADER, training_key_rows()))
    else:
        print(deepspeed_field_table())
