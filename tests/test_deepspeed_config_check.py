"""A DeepSpeed config the user hands ``train --deepspeed``: an unknown top-level key is warned of with the nearest
known one (DeepSpeed ignores it), and a value DeepSpeed refuses is one line naming the file, the key path and what
is allowed, before any model work. No engine, no process."""

from __future__ import annotations

import json
import logging

import pytest

from opsd_rollout.deepspeed_config import check_deepspeed_config, known_keys, refusal
from opsd_rollout.train import OptimizationConfig, TrainConfig
from opsd_rollout.train.setup import deepspeed_config_of

MONITORS = {"tensorboard": {"enabled": True, "output_path": "runs/tb", "job_name": "opsd"},
            "wandb": {"enabled": True, "project": "opsd"},
            "csv_monitor": {"enabled": True, "output_path": "runs/csv", "job_name": "opsd"}}


def run_config(deepspeed: str | dict, **fields) -> TrainConfig:
    return TrainConfig(**{"output_dir": "", "teachers": ["qwen2-tiny"], **fields},
                       optimization=OptimizationConfig(deepspeed=deepspeed))


def refused(ds: dict, source: str = "ds_config.json") -> str:
    with pytest.raises(ValueError) as caught:
        check_deepspeed_config(ds, source)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{source}: ")
    return message


def test_the_known_keys_come_from_deepspeed_itself():
    keys = known_keys()
    assert {"zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "tensorboard", "wandb", "csv_monitor",
            "gradient_clipping", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
            "steps_per_print"} <= keys
    assert {"sequence_parallel_size", "vocabulary_size"} <= keys  # read outside DeepSpeedConfig's reading
    assert "zero_optimisation" not in keys and "stage" not in keys and "enabled" not in keys


def test_a_misspelt_top_level_key_is_warned_of_with_the_nearest_known_one(caplog):
    ds = {"zero_optimisation": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    before = json.loads(json.dumps(ds))
    with caplog.at_level(logging.WARNING):
        warnings = check_deepspeed_config(ds, "ds_config.json")
    expected = ("ds_config.json: unknown key 'zero_optimisation' (did you mean 'zero_optimization'?); "
                "DeepSpeed ignores it")
    assert warnings == [expected]
    assert [record.getMessage() for record in caplog.records] == [expected]
    assert ds == before


def test_through_deepspeed_config_of_a_json_file_warns_and_keeps_the_rest(tmp_path, caplog):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimisation": {"stage": 2}, "zero_optimization": {"stage": 1},
                                "gradient_accumulation_steps": 4, **MONITORS}))
    with caplog.at_level(logging.WARNING):
        ds = deepspeed_config_of(run_config(str(path), prompts_per_micro_batch=2))
    assert [record.getMessage() for record in caplog.records] == [
        f"{path}: unknown key 'zero_optimisation' (did you mean 'zero_optimization'?); DeepSpeed ignores it"]
    assert ds["zero_optimization"] == {"stage": 1} and ds["zero_optimisation"] == {"stage": 2}
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["tensorboard"] == MONITORS["tensorboard"]
    caplog.clear()
    deepspeed_config_of(run_config(str(path)), check=False)  # the engine's second read
    assert not caplog.records


def test_a_stage_deepspeed_refuses_is_one_line_naming_the_file_the_key_and_what_is_allowed(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    with pytest.raises(ValueError) as caught:
        deepspeed_config_of(run_config(str(path)))
    assert str(caught.value) == f"{path}: zero_optimization.stage: 7 is not allowed; allowed: 0, 1, 2, 3"


def test_a_misspelt_nested_key_is_refused_as_deepspeed_would_with_the_nearest_known_one():
    assert refused({"zero_optimization": {"stagee": 2}}) == (
        "ds_config.json: unknown key 'zero_optimization.stagee' (did you mean 'zero_optimization.stage'?); "
        "DeepSpeed refuses it")
    assert "did you mean 'zero_optimization.offload_optimizer.device'?" in refused(
        {"zero_optimization": {"offload_optimizer": {"devic": "cpu"}}})
    assert "did you mean 'tensorboard.enabled'?" in refused({"tensorboard": {"enabld": True}})


@pytest.mark.parametrize("ds,expected", [
    ({"zero_optimization": {"stage": "three"}},
     'zero_optimization.stage: "three" is not allowed; allowed: 0, 1, 2, 3'),
    ({"train_micro_batch_size_per_gpu": "x"},
     'train_micro_batch_size_per_gpu: "x" is not allowed; allowed: an int >= 1'),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: 0 is not allowed; allowed: an int >= 1"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     'zero_optimization.offload_optimizer.device: "gpu" is not allowed; allowed: "none", "cpu", "nvme"'),
    ({"zero_optimization": {"overlap_comm": "x"}}, 'zero_optimization.overlap_comm: "x" is not allowed; input should '
     "be a valid boolean"),
    ({"zero_optimization": 3}, "zero_optimization: 3 is not allowed; allowed: a JSON object"),
    ({"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
     "zero_optimization: compute_grad_norm=false is supported only with ZeRO Stage 1 or 2"),
    ({"communication_data_type": "fp8"}, "Supported data types: ['fp16', 'bf16', 'fp32']. Got: fp8"),
    ({"checkpoint": 3}, "checkpoint: "),
    ({"elasticity": {"enabled": True}}, "Elastic training has been removed"),
])
def test_a_value_deepspeed_refuses_is_one_line(ds, expected):
    assert expected in refused(ds)


def test_a_valid_config_with_monitors_passes_without_a_word(caplog):
    ds = {**MONITORS, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupLR", "params": {}},
          "gradient_clipping": 1.0, "steps_per_print": 10, "train_micro_batch_size_per_gpu": 2}
    with caplog.at_level(logging.WARNING):
        assert check_deepspeed_config(ds, "ds_config.json") == []
    assert not caplog.records


def test_a_bad_config_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    from opsd_rollout.train import setup, train

    monkeypatch.setattr(setup, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match="^deepspeed config: zero_optimization.stage: 7 is not allowed"):
        train(run_config({"zero_optimization": {"stage": 7}}, output_dir=str(tmp_path / "run")))


def test_what_deepspeed_raises_later_is_one_line_too():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        DeepSpeedZeroConfig(stage=7, overlap_comm="x")
    assert "\n" in str(caught.value)
    message = refusal(caught.value)
    assert "\n" not in message and message.startswith("stage: 7 is not allowed") and message.endswith("(and 1 more)")
