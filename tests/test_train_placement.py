"""Every teacher runs where its student runs, in the run's precision: ``--dtype`` (auto: bf16 on a GPU, fp32 on the
CPU) and the DeepSpeed config's bf16/fp16 sections agree or are refused in one line, the student's engine takes
them, and each teacher follows it (several teachers, the self-teacher's starting weights, a ZeRO-3 teacher). The
CPU shows the dtype; the device is shown by the placement itself, on a stand-in device (``meta``); the GPU run is
``scripts/gpu_check.py``'s."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from opsd_rollout.cli import build_parser, main
from opsd_rollout.models import load_model
from opsd_rollout.opsd.self_teacher import SelfTeacher
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.train import TrainConfig, train, loop
from opsd_rollout.train.precision import place_teachers, run_dtype
from test_train import write_prompts

TINY = dict(student="llama-tiny", prompts_per_micro_batch=2, max_new_tokens=6, eval_prompts=2, eval_every=1, steps=1,
            progress=False)


def parameters(teacher) -> list[torch.Tensor]:
    """A teacher's own parameters (a self-teacher's copy's, an engine's module's), each partition's under ZeRO-3."""
    module = getattr(teacher, "module", teacher)
    return [getattr(p, "ds_tensor", p) for p in module.parameters()]


@pytest.fixture
def placed(monkeypatch):
    """Each run's student parameters' dtype and its teachers as the loop holds them, once placed."""
    seen = {}
    build = loop._Run.__init__

    def recording(run, *args, **kwargs):
        build(run, *args, **kwargs)
        teachers = run.teacher if isinstance(run.teacher, dict) else {"default": run.teacher}
        seen.update(student=next(run.engine.module.parameters()).dtype, teachers=teachers)

    monkeypatch.setattr(loop._Run, "__init__", recording)
    return seen


@pytest.mark.parametrize("teachers", [
    dict(teacher=["a=qwen2-tiny", "b=gpt2-tiny"]),
    dict(teacher="self"),
    dict(teacher="qwen2-tiny", teacher_zero_stage=3),
], ids=["several", "self-initial-copy", "zero3-teacher"])
def test_each_teacher_has_the_students_dtype(tmp_path, placed, teachers):
    train(TrainConfig.from_flat(dict(TINY, **teachers, dtype="bf16", output_dir=str(tmp_path / "run"),
                                     prompts=str(write_prompts(tmp_path / "p.jsonl")))))
    assert placed["student"] == torch.bfloat16
    for name, teacher in placed["teachers"].items():
        assert {p.dtype for p in parameters(teacher)} == {torch.bfloat16}, name
    if "self" in str(teachers):
        assert placed["teachers"]["default"].copied
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["dtype"] == "bf16" and saved["device"] == "auto"


def test_auto_is_fp32_on_the_cpu_and_the_deepspeed_config_decides_when_it_says(tmp_path, placed):
    common = dict(TINY, teacher="qwen2-tiny", prompts=str(write_prompts(tmp_path / "p.jsonl")), eval_every=10)
    train(TrainConfig.from_flat(dict(common, output_dir=str(tmp_path / "auto"))))
    assert placed["student"] == torch.float32 and parameters(placed["teachers"]["default"])[0].dtype == torch.float32
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    train(TrainConfig.from_flat(dict(common, output_dir=str(tmp_path / "config"), deepspeed=ds)))
    assert placed["student"] == torch.bfloat16 and parameters(placed["teachers"]["default"])[0].dtype == torch.bfloat16


@pytest.mark.parametrize("asked,ds,device,expected", [
    ("auto", None, "cuda", "bf16"), ("auto", None, "cpu", "fp32"), ("fp16", None, "cpu", "fp16"),
    ("auto", {"fp16": {"enabled": True}}, "cpu", "fp16"), ("auto", {"bf16": {"enabled": False}}, "cuda", "fp32"),
    ("auto", {"fp16": {"enabled": False}}, "cuda", "bf16"), ("auto", {"bf16": {"enabled": "auto"}}, "cpu", "fp32"),
    ("bf16", {"bfloat16": {"enabled": True}}, "cpu", "bf16"), ("bf16", {"fp16": {"enabled": False}}, "cpu", "bf16"),
    ("fp32", {"bf16": {"enabled": False}}, "cuda", "fp32"),
])
def test_the_runs_dtype_from_the_flag_the_config_and_the_device(asked, ds, device, expected):
    assert run_dtype(asked, ds, device, "ds.json") == expected


@pytest.mark.parametrize("asked,ds,said", [
    ("fp32", {"bf16": {"enabled": True}}, "--dtype fp32 and ds.json disagree: its bf16 on"),
    ("bf16", {"bf16": {"enabled": False}}, "--dtype bf16 and ds.json disagree: its bf16 off"),
    ("bf16", {"fp16": {"enabled": True}}, "--dtype bf16 and ds.json disagree: its fp16 on"),
])
def test_a_deepspeed_config_that_contradicts_the_dtype_is_one_line_before_any_model(tmp_path, capsys, monkeypatch,
                                                                                    asked, ds, said):
    from opsd_rollout.train import setup

    run_dtype("auto", ds, "cpu", "ds.json")  # alone, the config decides
    with pytest.raises(ValueError, match=said):
        run_dtype(asked, ds, "cpu", "ds.json")
    monkeypatch.setattr(setup, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, **ds}))
    assert main(["train", "--teacher", "qwen2-tiny", "--deepspeed", str(config), "--dtype", asked, "--output-dir",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--dtype {asked} and {config} disagree" in err


class _StandInEngine:
    """What the placement reads of a student's engine: its device (here ``meta``, standing in for a GPU) and its
    module, in the run's dtype."""

    def __init__(self, module: torch.nn.Module, zero_stage: int = 0):
        self.device, self.module, self.stage = torch.device("meta"), module, zero_stage

    def zero_optimization_stage(self) -> int:
        return self.stage


def test_the_placement_puts_each_teacher_on_the_students_device_in_its_dtype():
    student = load_model("llama-tiny", dtype="bf16")[0]
    engine = _StandInEngine(student.to("meta"))
    plain, other = load_model("qwen2-tiny")[0], load_model("gpt2-tiny")[0]
    copied = SelfTeacher.initial(load_model("llama-tiny")[0])
    live = SelfTeacher.live(student)
    served = ServedTeacher("http://127.0.0.1:9")
    placed = place_teachers({"a": plain, "b": other, "self": copied, "live": live, "served": served},
                            {"a": 0, "b": 0, "self": 0, "live": 0, "served": 0}, engine)
    for name in ("a", "b", "self"):
        tensors = [*parameters(placed[name]), *getattr(placed[name], "module", placed[name]).buffers()]
        assert {(t.device.type, t.dtype) for t in tensors if t.is_floating_point()} == {("meta", torch.bfloat16)}
    assert placed["live"] is live and placed["live"].module is student and placed["served"] is served
    one = place_teachers(load_model("qwen2-tiny")[0], {"default": 0}, engine)
    assert {p.device.type for p in one.parameters()} == {"meta"}


def test_train_eval_and_serve_teacher_take_the_same_dtype_and_device_flags():
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    needed = {"train": ["--output-dir", "o"], "eval": ["--model", "m", "--eval-data", "d", "--eval-scorer", "s"],
              "serve-teacher": ["--model", "m"]}
    flags, defaults = {}, {}
    for command, argv in needed.items():
        actions = {a.dest: a for a in subcommands[command]._actions}
        flags[command] = [(actions[dest].choices, actions[dest].type, actions[dest].metavar)
                          for dest in ("dtype", "device")]
        parsed = parser.parse_args([command, *argv, "--dtype", "bf16", "--device", "cuda:1"])
        assert (parsed.dtype, parsed.device) == ("bf16", "cuda:1")
        parsed = parser.parse_args([command, *argv])
        defaults[command] = (parsed.dtype or TrainConfig.__dataclass_fields__["dtype"].default,
                             parsed.device or TrainConfig.__dataclass_fields__["device"].default)
    assert flags["train"] == flags["eval"] == flags["serve-teacher"]
    assert set(defaults.values()) == {("auto", "auto")}


def test_a_device_deepspeed_does_not_run_on_is_refused(tmp_path):
    from opsd_rollout.train.precision import run_device_type

    assert run_device_type("auto") == "cpu" == run_device_type("cpu")
    with pytest.raises(ValueError, match="--device cuda:1: this machine has no CUDA device"):
        run_device_type("cuda:1")
