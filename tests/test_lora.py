"""LoRA students (``--lora-rank``): PEFT's adapters are the only parameters trained and the only ones the optimizer
holds, at every ZeRO stage; rollouts run with the adapters merged and the weights put back exactly; checkpoints hold
the adapters alone and ``--resume`` continues exactly; ``model/`` is PEFT's adapter directory, ``merged/`` the
merged model, and both give the trained student's logits."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from opsd_rollout.train import TrainConfig

peft = pytest.importorskip("peft")

TINY = dict(student="llama-tiny", teacher="qwen2-tiny", prompts_per_micro_batch=2, max_new_tokens=8, eval_prompts=2,
            eval_every=2, progress=False, lr=1e-2, lora_rank=4, temperature=1.0)


def config(out, **changes) -> TrainConfig:
    return TrainConfig.from_flat({"output_dir": str(out), **TINY, **changes})


def run(cfg: TrainConfig):
    """The loop's run object after ``run()``: its engine is the trained student's."""
    from opsd_rollout.train.loop import _Run
    from opsd_rollout.train.setup import load_models, split_examples

    models = load_models(cfg)
    examples, held_out = split_examples(cfg, None)
    state = _Run(cfg, models, examples, held_out)
    state.result = state.run()
    return state


def managed_parameters(engine, stage: int) -> list[torch.nn.Parameter]:
    """The parameters the engine's optimizer updates, by stage: torch's AdamW's groups at ZeRO-0, DeepSpeed's
    16-bit groups at 1-2, its fp16 groups at 3."""
    optimizer = engine.optimizer
    if stage == 0:
        return [p for group in optimizer.param_groups for p in group["params"]]
    groups = optimizer.bit16_groups if stage in (1, 2) else optimizer.fp16_groups
    return [p for group in groups for p in group]


def optimizer_state_numel(engine, stage: int) -> int:
    """Elements of the optimizer's fp32 state (Adam's first moments: one a trained element, padding aside)."""
    optimizer = engine.optimizer
    if stage == 0:
        return sum(state["exp_avg"].numel() for state in optimizer.state.values())
    inner = optimizer.optimizer
    flat = (optimizer.single_partition_of_fp32_groups if stage in (1, 2)  # what DeepSpeed's optimizer steps on
            else optimizer.fp32_partitioned_groups_flat)
    return sum(inner.state[p]["exp_avg"].numel() for p in flat)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_the_adapters_train_and_the_optimizer_holds_only_theirs(tmp_path, stage):
    from opsd_rollout.models import load_model

    state = run(config(tmp_path / "run", steps=2, zero_stage=stage))
    engine = state.engine
    named = dict(engine.module.named_parameters())
    adapters = {name for name, p in named.items() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert {id(p) for p in managed_parameters(engine, stage)} == {id(named[n]) for n in adapters}
    adapter_numel = sum(int(getattr(named[n], "ds_numel", named[n].numel())) for n in adapters)
    # r (in + out) for each linear layer of llama-tiny's 2: q, k, v, o (64 -> 64, 32, 32; 64 -> 64), gate, up, down
    assert adapter_numel == state.result.records[0]["trainable_parameters"] == 2 * 4 * (
        128 + 96 + 96 + 128 + 192 + 192 + 192) == 8192
    assert adapter_numel <= optimizer_state_numel(engine, stage) < adapter_numel + 64  # DeepSpeed pads to alignment
    import deepspeed

    original = dict(load_model("llama-tiny")[0].named_parameters())

    with deepspeed.zero.GatheredParameters([p for n, p in named.items() if n not in adapters], enabled=stage == 3):
        for name, param in named.items():
            if name in adapters:
                continue
            before = original[name.replace("base_model.model.", "").replace(".base_layer", "")]
            assert torch.equal(param.detach(), before), name  # the frozen base, bit for bit after 2 merged rollouts


def adapter_weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoints_hold_the_adapters_and_resume_exactly(tmp_path, stage):
    """2 steps and a resume to 4 give the uninterrupted run's losses, evaluation and adapters, bit for bit; the
    checkpoint holds the adapters and their optimizer state, not the frozen base."""
    from opsd_rollout.train import train

    whole = train(config(tmp_path / "whole", steps=4, zero_stage=stage))
    train(config(tmp_path / "half", steps=2, zero_stage=stage))
    resumed = train(config(tmp_path / "half", steps=4, zero_stage=stage, resume=str(tmp_path / "half")))
    assert [r.get("loss") for r in resumed.records] == [r.get("loss") for r in whole.records]
    assert resumed.records[-1]["eval_reverse_kl"] == whole.records[-1]["eval_reverse_kl"]
    ours, theirs = adapter_weights(tmp_path / "half" / "model"), adapter_weights(tmp_path / "whole" / "model")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(float(v.abs().sum()) > 0 for k, v in ours.items() if "lora_B" in k)  # trained (B starts at zero)
    files = list((tmp_path / "half" / "checkpoints" / "step4").glob("*model_states.pt"))
    module = torch.load(files[0], weights_only=False)["module"] or {}
    assert all("lora_" in name for name in module)  # ZeRO-3 keeps none here; its partitions hold the adapters'
    saved = sum(f.stat().st_size for f in (tmp_path / "half" / "checkpoints" / "step4").iterdir())
    assert saved < 300_000  # the adapters (8,192) and Adam's two moments, not the base's 140,000 parameters


def test_model_is_peft_adapters_and_merged_the_merged_model(tmp_path):
    """``PeftModel.from_pretrained`` on the base loads model/; its logits are the trained student's, and merged/'s
    (``--merge-lora``) the same up to rounding; ``models.load_model`` takes model/ too (merged), so it can be a
    teacher or a student again."""
    from peft import PeftModel

    from opsd_rollout.models import load_model

    state = run(config(tmp_path / "run", steps=2, merge_lora=True))
    out = tmp_path / "run"
    assert json.loads((out / "model" / "adapter_config.json").read_text())["base_model_name_or_path"] == "llama-tiny"
    assert not (out / "model" / "config.json").exists() and (out / "merged" / "config.json").is_file()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        trained = state.engine.module.eval()(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(load_model("llama-tiny")[0], str(out / "model"))
        assert torch.equal(peft_model(input_ids=ids).logits, trained)
        merged, _ = load_model(str(out / "merged"))
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
        again, _ = load_model(str(out / "model"))
        torch.testing.assert_close(again(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
    assert state.result.merged_dir == out / "merged"


def test_merged_rollouts_put_the_weights_back_exactly(tiny_models, tokenizer):
    """PEFT's merge then unmerge leaves a rounding in the weights (checked here: it does on this model); a merged
    rollout leaves none, and samples what the unmerged rollout samples."""
    import copy

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, RolloutRequest, SamplingConfig
    from opsd_rollout.train.lora import AdapterConfig, with_adapters

    model = with_adapters(copy.deepcopy(tiny_models["llama-tiny"]), AdapterConfig(rank=4), "llama-tiny", seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = copy.deepcopy(model)
    probe.merge_adapter()
    probe.unmerge_adapter()
    assert any(not torch.equal(p, before[n]) for n, p in probe.named_parameters())  # PEFT's own round trip drifts
    ids = torch.randint(3, 259, (2, 6), generator=torch.Generator().manual_seed(0))
    request, sampling = RolloutRequest(ids, torch.ones_like(ids)), SamplingConfig(max_new_tokens=6, temperature=0.0)
    batches = {merge: HybridEngineRollout(model, tokenizer, HybridEngineRolloutConfig(merge_adapters=merge)).generate(
        request, sampling) for merge in (True, False)}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(batches[True].input_ids, batches[False].input_ids)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_train_lora_adapters_and_resume_exactly(tmp_path, stage):
    """Under torchrun, 2 ranks (ZeRO-2: the optimizer state partitioned; ZeRO-3: the adapters too): 2 steps and a resume to 4 give the uninterrupted run's adapters bit for bit,
    and model/ is PEFT's adapter directory of the whole (gathered) adapters."""
    from conftest import clean_env, run_named
    from opsd_rollout.distributed import free_port

    def launch(out, steps, *extra):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), "-m", "opsd_rollout", "train", "--student",
                   "llama-tiny", "--teacher", "qwen2-tiny", "--steps", str(steps), "--prompts-per-micro-batch", "2",
                   "--max-new-tokens", "8", "--eval-every", "2", "--eval-prompts", "4", "--zero-stage", str(stage),
                   "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--lr", "1e-2", "--output-dir", str(out),
                   "--quiet", *extra]
        result = run_named(f"LoRA train on 2 ZeRO-{stage} ranks (about 20 s on 2 quiet cores)", command,
                           env={**clean_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=1500)
        assert result.returncode == 0, result.stderr[-4000:]

    launch(tmp_path / "whole", 4)
    launch(tmp_path / "half", 2)
    launch(tmp_path / "half", 4, "--resume", str(tmp_path / "half"))
    ours, theirs = adapter_weights(tmp_path / "half" / "model"), adapter_weights(tmp_path / "whole" / "model")
    assert len(ours) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B), whole
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    lines = [json.loads(line) for line in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4]
    assert lines[0]["trainable_parameters"] == 2 * 4 * ((64 + 64) + (64 + 32))  # the whole adapters, not a rank's
