"""``--gradient-checkpointing``: the student's layers recompute their activations in the backward pass (each
decoder layer runs twice in training mode a micro-batch: its forward and its recomputation), under every ZeRO stage
and with LoRA adapters, and the run is the same run: losses, gradient norms and the trained weights equal those
without it. Rollouts are untouched (eval mode: no recomputation, the cache on). The memory it saves is measured in
benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest
import torch

from opsd_rollout.modeling import innermost_model
from opsd_rollout.train import TrainConfig, loop, train
from test_train import write_prompts

TINY = dict(student="llama-tiny", teacher="qwen2-tiny", prompts_per_micro_batch=2, max_new_tokens=6, eval_prompts=2,
            eval_every=10, steps=2, progress=False, lr=1e-2, temperature=1.0, gradient_accumulation_steps=2)


@pytest.fixture
def layer_calls(monkeypatch):
    """Per run: how often the student's first decoder layer ran in training mode (its MLP's calls: transformers
    checkpoints a layer's ``forward``, so the layer's own hooks run once), and its weights at the end."""
    seen = []
    build, run = loop._Run.__init__, loop._Run.run

    def recording(self, *args, **kwargs):
        build(self, *args, **kwargs)
        layer = innermost_model(self.engine.module).model.layers[0].mlp
        calls = {"train": 0, "eval": 0}
        layer.register_forward_pre_hook(lambda m, _: calls.__setitem__("train" if m.training else "eval",
                                                                         calls["train" if m.training else "eval"] + 1))
        seen.append(calls)

    def finishing(self):
        result = run(self)
        seen[-1]["weights"] = {n: p.detach().clone() for n, p in self.engine.module.named_parameters()
                               if p.requires_grad and not hasattr(p, "ds_tensor")}
        return result

    monkeypatch.setattr(loop._Run, "__init__", recording)
    monkeypatch.setattr(loop._Run, "run", finishing)
    return seen


@pytest.mark.parametrize("zero_stage,lora", [(0, False), (1, True), (2, False), (3, False), (3, True)])
def test_checkpointing_recomputes_the_layers_and_trains_the_same(tmp_path, layer_calls, zero_stage, lora):
    data = str(write_prompts(tmp_path / "p.jsonl"))
    runs = {}
    for checkpointing in (False, True):
        runs[checkpointing] = train(TrainConfig.from_flat(dict(
            TINY, prompts=data, zero_stage=zero_stage, gradient_checkpointing=checkpointing,
            output_dir=str(tmp_path / str(checkpointing)), **(dict(lora_rank=4) if lora else {}))))
    plain, checkpointed = layer_calls
    micro_batches = TINY["steps"] * TINY["gradient_accumulation_steps"]
    assert plain["train"] == micro_batches and checkpointed["train"] == 2 * micro_batches
    assert plain["eval"] == checkpointed["eval"] > 0  # rollouts and evaluation: once each, as before
    for key in ("loss", "grad_norm", "response_tokens"):
        assert [r[key] for r in runs[True].records[1:]] == pytest.approx([r[key] for r in runs[False].records[1:]],
                                                                          rel=1e-5), key
    for name, weight in plain["weights"].items():
        torch.testing.assert_close(checkpointed["weights"][name], weight, rtol=1e-5, atol=1e-6)


def test_a_student_without_checkpointing_in_transformers_is_refused():
    from opsd_rollout.train.setup import checkpointed

    with pytest.raises(ValueError, match="--gradient-checkpointing: student 'x' .* has no gradient checkpointing"):
        checkpointed(torch.nn.Linear(2, 2), "x")
