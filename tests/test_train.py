"""``opsd-rollout train``: data formats, the loop's accounting (accumulation, lmbda, evaluation), exact resume,
Ctrl-C, metrics in metrics.jsonl and DeepSpeed's monitors, and bad input refused before any work. Tiny models,
a few steps each."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from opsd_rollout.cli import main
from opsd_rollout.metrics import STEP_STAGES, TIME, TRAINING
from opsd_rollout.models import byte_tokenizer
from opsd_rollout.train import Example, TrainConfig, read_examples, train
from opsd_rollout.train.data import Encoder, batch_indices

TINY = dict(student="llama-tiny", teacher="qwen2-tiny", prompts_per_micro_batch=2, max_new_tokens=8,
            eval_prompts=4, eval_every=2, progress=False, lr=1e-3)


def flat_config(**values) -> TrainConfig:
    """A config by the flags' names (``TrainConfig.from_flat``), as the command line makes it."""
    return TrainConfig.from_flat(values)


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def write_prompts(path: Path, count: int = 12, reference: bool = True) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Question {i}: why?", **({"reference": f" because {i}."}
                                                                          if reference else {})}) + "\n"
                            for i in range(count)))
    return path


# ---- data ---------------------------------------------------------------------------------------------------------

def test_prompt_files_in_every_format(tmp_path):
    tokenizer = byte_tokenizer()
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a", "reference": "b"}\n{"prompt": "c", "completion": "d"}\n'
                     '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    assert read_examples(jsonl, tokenizer) == [Example("a", "b"), Example("c", "d"),
                                               Example("user: hi\nassistant: yo")]  # the turn to continue
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\nsecond prompt\n")
    assert read_examples(plain, tokenizer) == [Example("first prompt"), Example("second prompt")]


def test_a_chat_template_renders_messages_when_the_tokenizer_has_one(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
                              "{% if add_generation_prompt %}<assistant>{% endif %}"
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hi"}]}) + "\n")
    assert read_examples(path, tokenizer) == [Example("<system>be brief<user>hi<assistant>")]


@pytest.mark.parametrize("content,message", [(None, "does not exist"), ("\n\n", "holds no prompt"),
                                             ('{"text": "x"}\n', "neither a 'prompt' nor 'messages'"),
                                             ('{"prompt": "x"\n', "line 1 is not JSON")])
def test_bad_prompt_files_are_named(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_examples(path, byte_tokenizer())


def test_the_data_order_is_a_function_of_seed_and_micro_batch_only():
    seen = [i for m in range(5) for i in batch_indices(7, 3, seed=4, micro_batch=m)]
    assert sorted(seen[:7]) == list(range(7)) and sorted(seen[7:14]) == list(range(7))  # every epoch whole
    assert batch_indices(7, 3, seed=4, micro_batch=3) == seen[9:12]
    assert batch_indices(7, 3, seed=5, micro_batch=0) != seen[:3]


def test_references_become_a_rollout_batch_of_the_contract():
    tokenizer = byte_tokenizer()
    encoder = Encoder(tokenizer, max_prompt_tokens=64, max_reference_tokens=3)
    batch = encoder.with_references([Example("ab", "xyzw"), Example("abcd", "q")], torch.device("cpu"), samples=2)
    assert batch.input_ids.shape == (4, 4 + 3) and batch.response_start_idx.tolist() == [4] * 4
    mask = batch.attention_mask.tolist()  # "xyzw" cut to 3 tokens (no EOS: it did not end there), "q" and its EOS
    assert mask[0] == [0, 0, 1, 1, 1, 1, 1] and mask[2] == [1] * 6 + [0]
    assert tokenizer.decode(batch.input_ids[0, 4:]) == "xyz" and batch.input_ids[2, 5] == tokenizer.eos_token_id
    assert torch.equal(batch.input_ids[0], batch.input_ids[1])  # repeat_interleave order


# ---- the config ---------------------------------------------------------------------------------------------------

def test_the_flags_names_land_in_their_sections():
    from deepspeed.runtime.rollout.base import SamplingConfig

    from opsd_rollout.opsd.divergence import DivergenceConfig
    from opsd_rollout.opsd.teacher import TeacherCacheConfig
    from opsd_rollout.train import OptimizationConfig
    from opsd_rollout.train.teacher_spec import TeacherSpec

    flat = flat_config(output_dir="o", teacher="qwen2-tiny", samples_per_prompt=4, max_new_tokens=16, top_k=5,
                       loss="sampled_reverse_kl", estimator="k3", teacher_top_k=8, lr=3e-4, zero_stage=2, steps=7)
    assert flat == TrainConfig(
        output_dir="o", teachers=(TeacherSpec(source="qwen2-tiny"),), steps=7,
        sampling=SamplingConfig(max_new_tokens=16, n_samples_per_prompt=4, top_k=5),
        divergence=DivergenceConfig(loss="sampled_reverse_kl", estimator="k3"),
        teacher_cache=TeacherCacheConfig(mode="sampled", top_k=8),  # the loss's mode: only k was named
        optimization=OptimizationConfig(lr=3e-4, zero_stage=2))
    assert flat_config(output_dir="o", teacher="t").cache.mode == "full"
    assert flat_config(output_dir="o", teacher="t", loss="sampled_reverse_kl").cache.mode == "sampled"
    with pytest.raises(ValueError, match="unknown train config field batch_sz"):
        flat_config(output_dir="o", teacher="t", batch_sz=2)
    with pytest.raises(TypeError, match="divergence must be a DivergenceConfig; got dict"):
        TrainConfig(output_dir="o", teachers=["t"], divergence={"loss": "jsd"})
    with pytest.raises(ValueError, match="sampling.top_p"):
        flat_config(output_dir="o", teacher="t", top_p=0)


def test_a_saved_config_loads_back_and_an_old_flat_one_is_refused(tmp_path):
    from opsd_rollout.rollout import HybridEngineRolloutConfig
    from opsd_rollout.train import load_train_config

    config = flat_config(output_dir="o", teacher="qwen2-tiny", teacher_cache="topk", teacher_top_k=8, lr=2e-3)
    config = dataclasses.replace(config, rollout=HybridEngineRolloutConfig.from_flat(
        enable_profiling=True, stop_check_interval=4, use_shared_prefill=True))
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps(config.to_dict()))
    assert load_train_config(path) == config
    old = {"output_dir": "o", "student": "llama-tiny", "teacher": "qwen2-tiny", "zero_stage": 0, "lr": 0.002,
           "steps": 100, "teacher_cache": "topk", "teacher_top_k": 8, "seed": 0}
    path.write_text(json.dumps(old))  # fields of the flat TrainConfig before the sections
    with pytest.raises(ValueError) as refused:
        load_train_config(path)
    assert str(refused.value) == (
        "a flat train config of an older release: this release keeps zero_stage in optimization.zero_stage, lr in "
        "optimization.lr, teacher_cache in teacher_cache.mode, teacher_top_k in teacher_cache.top_k; move each into "
        "its section, or start a new run")


# ---- the loop -----------------------------------------------------------------------------------------------------

def test_a_run_writes_metrics_checkpoint_model_and_plot(tmp_path):
    out = tmp_path / "run"
    result = train(flat_config(output_dir=str(out), steps=4, **TINY))
    lines = records(out)
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4]
    assert set(lines[0]) == {"step", "trainable_parameters", "eval_reverse_kl", "eval_cross_entropy",
                             "time/evaluation_ms"}  # no update yet
    assert lines[0]["trainable_parameters"] == 107_200  # every weight of llama-tiny (full fine-tuning)
    assert [("eval_reverse_kl" in r) for r in lines] == [True, False, True, False, True]
    step = lines[1]
    for key in ("loss", "grad_norm", "learning_rate", "epoch", "divergence", "response_tokens", "time/total_ms",
                "time/rollout_ms", "time/teacher_forward_ms", "time/backward_ms", "time/optimizer_ms",
                "time/rollout_share", "time/rollout/decode_ms", "peak_memory_bytes", "rss_bytes"):
        assert key in step, key
    assert step["divergence"] == "jsd" and step["learning_rate"] == 1e-3 and 0 < step["time/rollout_share"] < 1
    parts = sum(step[TIME + k] for k in STEP_STAGES)
    assert parts <= step["time/total_ms"] <= step["time/step_ms"]
    assert [r["epoch"] for r in lines[1:]] == pytest.approx([k * lines[1]["epoch"] for k in (1, 2, 3, 4)])
    assert lines[4]["time/steps_s"] == pytest.approx(sum(r["time/step_ms"] for r in lines[1:]) / 1e3)
    assert all(r["grad_norm"] > 0 for r in lines[1:])
    assert {key for r in lines for key in r} <= set(TRAINING)  # every key defined in metrics.py
    assert result.steps == 4 and (out / "checkpoints" / "latest").read_text().strip() == "step4"
    from opsd_rollout.train import load_train_config

    assert load_train_config(out / "train_config.json") == flat_config(output_dir=str(out), steps=4, **TINY)
    assert (out / "model" / "config.json").is_file() and result.plot == out / "eval.png" and result.plot.is_file()
    from opsd_rollout.models import load_model

    reloaded, _ = load_model(str(out / "model"))  # the final student loads as a local checkpoint
    assert reloaded.config.num_hidden_layers == 2


def test_resume_continues_exactly(tmp_path):
    """3 steps and a resume to 6 give the losses of an uninterrupted 6-step run: the data order, the rollouts'
    random numbers and lmbda's draws are the same, and the optimizer's state comes back."""
    config = dict(TINY, lmbda=0.5, gradient_accumulation_steps=2, temperature=1.0, eval_every=3)
    whole = train(flat_config(output_dir=str(tmp_path / "whole"), steps=6, **config))
    train(flat_config(output_dir=str(tmp_path / "half"), steps=3, **config))
    resumed = train(flat_config(output_dir=str(tmp_path / "half"), steps=6, resume=str(tmp_path / "half"), **config))
    assert [r["on_policy"] for r in whole.records[1:]] != [True] * 6  # both kinds of step were taken
    assert all(r["micro_batches"] == 2 for r in whole.records[1:])
    losses = [(r["step"], r["loss"]) for r in whole.records if "loss" in r]
    assert [(r["step"], r["loss"]) for r in resumed.records if "loss" in r] == losses
    assert [r["step"] for r in records(tmp_path / "half")] == [0, 1, 2, 3, 4, 5, 6]  # one record a step, no repeat
    assert resumed.records[-1]["eval_reverse_kl"] == whole.records[-1]["eval_reverse_kl"]


def test_gradient_accumulation_steps_the_optimizer_once_per_step(tmp_path):
    out = tmp_path / "run"
    train(flat_config(output_dir=str(out), steps=2, gradient_accumulation_steps=3, **TINY))
    state = torch.load(out / "checkpoints" / "step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["global_steps"] == 2 and state["train_state"]["micro_batches"] == 6
    assert all(r["micro_batches"] == 3 for r in records(out)[1:])


@pytest.mark.parametrize("lmbda,expected", [(0.0, {False}), (1.0, {True})])
def test_lmbda_is_the_fraction_of_on_policy_steps(tmp_path, lmbda, expected):
    result = train(flat_config(output_dir=str(tmp_path / "run"), steps=3, lmbda=lmbda, **TINY))
    assert {r["on_policy"] for r in result.records[1:]} == expected


@pytest.mark.parametrize("references,off_policy", [(False, "auto"), (True, "teacher")])
def test_supervised_kd_on_the_teachers_samples(tmp_path, references, off_policy):
    prompts = write_prompts(tmp_path / "p.jsonl", reference=references)
    result = train(flat_config(output_dir=str(tmp_path / "run"), steps=2, lmbda=0.0, prompts=str(prompts),
                               off_policy=off_policy, **TINY))
    assert all(r["time/rollout/decode_ms"] > 0 and not r["on_policy"] for r in result.records[1:])  # teacher rolled out
    assert ("eval_cross_entropy" in result.records[0]) == references  # cross-entropy where there are references


def test_off_policy_steps_train_on_the_references_when_there_are_some(tmp_path):
    result = train(flat_config(output_dir=str(tmp_path / "run"), steps=2, lmbda=0.0, **TINY))
    assert all("time/rollout/decode_ms" not in r and r["response_tokens"] == 2 * 8 for r in result.records[1:])


def test_sft_is_the_cross_entropy_on_the_references(tmp_path):
    from opsd_rollout.deepspeed_engine import build_engine
    from opsd_rollout.models import load_model
    from opsd_rollout.train import sft_step

    model, tokenizer = load_model("llama-tiny")
    batch = Encoder(tokenizer, max_prompt_tokens=64, max_reference_tokens=8).with_references(
        [Example("Hello", " world!"), Example("A longer prompt", " x")], torch.device("cpu"))
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    start = int(batch.response_start_idx[0])
    real = batch.attention_mask[:, start:].bool()  # the reference tokens, not their padding
    expected = torch.nn.functional.cross_entropy(logits[:, start - 1:-1][real], batch.input_ids[:, start:][real])
    engine = build_engine(model.train(), 0, lr=1e-3)
    profile = sft_step(engine, batch)
    assert profile.loss == pytest.approx(float(expected), rel=1e-5)
    assert profile.rollout is None and profile.response_tokens == 7 + 2 + 2  # an EOS after each


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_the_gradient_norm_is_the_accumulated_gradients_before_clipping(zero_stage):
    """The norm of the gradient the optimizer steps on: the micro-batches' mean (DeepSpeed scales each by 1 /
    gradient_accumulation_steps), before clipping (set to bite here), none at a micro-batch that does not step;
    taken before the step at ZeRO-0, where DeepSpeed keeps none, and DeepSpeed's own at ZeRO-2: the same number."""
    import copy

    import deepspeed

    from opsd_rollout.deepspeed_engine import deepspeed_config, init_distributed
    from opsd_rollout.models import load_model
    from opsd_rollout.modeling import position_ids
    from opsd_rollout.train import sft_step

    model, tokenizer = load_model("llama-tiny")
    reference = copy.deepcopy(model)
    encoder = Encoder(tokenizer, max_prompt_tokens=64, max_reference_tokens=8)
    batches = [encoder.with_references(pair, torch.device("cpu")) for pair in (
        [Example("Hello", " world!"), Example("A longer prompt", " x")],
        [Example("Why", " because."), Example("Then", " now then")])]
    for batch in batches:  # the reference: each micro-batch's token mean, halved, accumulated
        logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=position_ids(batch.attention_mask)).logits
        start = int(batch.response_start_idx[0])
        real = batch.attention_mask[:, start:].bool()
        loss = torch.nn.functional.cross_entropy(logits[:, start - 1:-1][real], batch.input_ids[:, start:][real])
        (loss / 2).backward()
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])))
    init_distributed()
    ds = {**deepspeed_config(zero_stage, lr=1e-3, micro_batch_size=2), "gradient_accumulation_steps": 2,
          "gradient_clipping": expected / 10}
    engine, *_ = deepspeed.initialize(model=model.train(), model_parameters=list(model.parameters()), config=ds)
    first, second = (sft_step(engine, batch, grad_norm=True) for batch in batches)
    assert first.grad_norm is None and second.grad_norm == pytest.approx(expected, rel=1e-4)
    assert sft_step(engine, batches[0]).grad_norm is None  # not asked: nothing computed


@pytest.fixture(scope="module")
def confident_teacher(tmp_path_factory):
    """qwen2-tiny with its head scaled up, saved as a local checkpoint: far from the student, so that one
    token's log-probability carries a signal above the sampling noise in a few steps."""
    from opsd_rollout.models import load_model

    model, tokenizer = load_model("qwen2-tiny")
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    directory = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("loss", [dict(loss="jsd"),
                                  dict(loss="sampled_reverse_kl", estimator="k1", samples_per_prompt=4),
                                  dict(loss="sampled_reverse_kl", estimator="k3", samples_per_prompt=4)])
def test_distillation_brings_the_student_closer_to_the_teacher(tmp_path, confident_teacher, loss):
    """A sign error moves the student away. One sampled token carries a weak signal: with one sample a prompt, 40
    steps moved the held-out KL by -0.4% to -8% depending on the seed, so the sampled losses draw 4 samples a prompt
    (-11% to -13% at seeds 0 and 1) and evaluate 32 prompts, where the gain stands well clear of the noise."""
    sampled = loss["loss"] == "sampled_reverse_kl"
    result = train(flat_config(output_dir=str(tmp_path / "run"), steps=40, **{
        **TINY, "teacher": confident_teacher, "lr": 3e-3, "eval_every": 40, "eval_prompts": 32 if sampled else 8,
        "prompts_per_micro_batch": 8, **loss}))
    (_, first), (_, last) = result.eval_curve()
    assert last < (0.9 if loss["loss"] == "jsd" else 0.96) * first, result.eval_curve()
    if sampled:  # 4 bytes a position of the response window
        first_step = result.records[1]
        assert first_step["teacher_cache_bytes"] == 4 * 32 * 8  # 8 prompts x 4 samples x 8 positions x 4 bytes


def test_ctrl_c_saves_a_checkpoint_and_leaves_valid_files(tmp_path, monkeypatch):
    from opsd_rollout.opsd.step import OPSDStep

    calls, step = [], OPSDStep.start

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(OPSDStep, "start", interrupted)
    out = tmp_path / "run"
    result = train(flat_config(output_dir=str(out), steps=5, **TINY))
    assert result.interrupted and result.steps == 2
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
    assert [r["step"] for r in records(out)] == [0, 1, 2]
    monkeypatch.setattr(OPSDStep, "start", step)
    resumed = train(flat_config(output_dir=str(out), steps=5, resume=str(out), **TINY))
    assert not resumed.interrupted and [r["step"] for r in records(out)] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("objective", ["opsd", "sft"])
def test_metrics_reach_deepspeeds_monitors_under_the_registrys_names(tmp_path, objective):
    """Every key a run writes is defined in metrics.py (``TRAINING``), and every event DeepSpeed's monitors receive
    is named by it: the training figures under ``train/``, the held-out evaluation alone under ``eval/``, every time
    under ``time/``; the gradient norm is logged for OPSD and SFT steps alike."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from opsd_rollout.train.setup import deepspeed_config_of

    config = dict(TINY, objective=objective, **({"teacher": None} if objective == "sft" else {}))
    ds = deepspeed_config_of(flat_config(output_dir="", steps=1, **config))
    ds["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"}
    ds["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"}
    result = train(flat_config(output_dir=str(tmp_path / "out"), steps=2, deepspeed=ds, **config))
    assert {key for r in result.records for key in r} <= set(TRAINING)
    assert all(r["grad_norm"] > 0 and r["learning_rate"] == 1e-3 for r in result.records[1:])
    loss = (tmp_path / "csv" / "run" / "train_loss.csv").read_text().splitlines()
    assert loss[0].startswith("step") and [line.split(",")[0] for line in loss[1:]] == ["1", "2"]
    evaluated = "eval_reverse_kl" if objective == "opsd" else "eval_cross_entropy"
    assert (tmp_path / "csv" / "run" / f"{evaluated}.csv").read_text().splitlines()[1].startswith("0,")
    events = EventAccumulator(str(tmp_path / "tb" / "run"))
    events.Reload()
    ours = {tag for tag in events.Tags()["scalars"] if not tag.startswith("Train/Samples/")}  # DeepSpeed's own
    sent = {TRAINING[key].monitor for r in result.records for key, value in r.items()
            if TRAINING[key].monitor and isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert ours == sent and {"train/loss", "train/grad_norm", "train/learning_rate", "time/step_ms"} <= ours
    evaluation = {"eval/cross_entropy"} | ({"eval/reverse_kl"} if objective == "opsd" else set())  # with a teacher
    assert {tag for tag in ours if tag.startswith("eval/")} == evaluation
    assert all(tag.startswith(TIME) for tag in ours if tag.endswith(("_ms", "_s")))
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx(
        [r["grad_norm"] for r in result.records[1:]])


def test_the_registry_names_every_figure_once_and_puts_times_under_time():
    monitors = [m.monitor for m in TRAINING.values() if m.monitor]
    assert len(monitors) == len(set(monitors))  # one name per figure
    assert all(m.monitor.startswith(TIME) for m in TRAINING.values() if m.unit in ("ms", "s"))
    assert {m.name for m in TRAINING.values() if (m.monitor or "").startswith("eval/")} == {
        "eval_reverse_kl", "eval_reverse_kl/NAME", "eval_cross_entropy", "eval_accuracy", "eval_unextractable",
        "eval_pass@1", "eval_pass@K",
        *(f"teacher_eval_{name}" for name in ("accuracy", "unextractable", "pass@1", "pass@K"))
    }  # the held-out and task evaluations alone; not engine.eval()'s time
    assert all(m.monitor is None for m in TRAINING.values() if m.unit in ("text", "bool"))
    assert {"loss", "grad_norm", "learning_rate", "epoch"} <= set(TRAINING)  # TRL's names
    assert all(m.merge in ("max", "sum", "mean") and m.meaning for m in TRAINING.values())


def test_monitor_events_refuse_a_key_the_registry_lacks():
    from opsd_rollout.train.report import monitor_events

    record = {"step": 3, "loss": 0.5, "divergence": "jsd", "on_policy": True, "grad_norm": None,
              "time/eval_ms": 1.5, "eval_reverse_kl": 0.25}
    assert monitor_events(record) == [("train/loss", 0.5, 3), ("time/eval_ms", 1.5, 3), ("eval/reverse_kl", 0.25, 3)]
    with pytest.raises(ValueError, match="'eval_ms' is not in metrics.TRAINING"):
        monitor_events({"step": 3, "eval_ms": 1.5})


# ---- bad input, refused before any work --------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    (dict(teacher="qwen2-0.5b"), "vocabulary of 259 tokens and teacher 'qwen2-0.5b' one of 151,936"),
    (dict(max_prompt_tokens=2), "prompt 1 has"),
    (dict(max_new_tokens=1020, max_prompt_tokens=8), "exceed the models' 1024 positions"),
    (dict(resume="NOWHERE"), "holds no checkpoint"),
    (dict(prompts="missing.jsonl"), "does not exist"),
    (dict(lmbda=1.5), "lmbda must be in"),
    (dict(off_policy="references", prompts="NOREFS"), "off_policy references trains on references"),
    (dict(loss="sampled_reverse_kl", lmbda=0.5), "lmbda must be 1"),
    (dict(loss="jsd", teacher_cache="sampled"), "needs the teacher's whole distribution"),
    (dict(loss="sampled_reverse_kl", estimator="k2"), "estimator must be one of"),
    (dict(objective="sft", prompts="NOREFS"), "objective sft trains on references"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, monkeypatch, change, message):
    from opsd_rollout.train import loop

    monkeypatch.setattr(loop, "build_student_engine", lambda *a: pytest.fail("reached the engine"))
    monkeypatch.chdir(tmp_path)
    if change.get("prompts") == "NOREFS":
        change = {**change, "prompts": str(write_prompts(tmp_path / "p.jsonl", reference=False))}
    with pytest.raises(ValueError, match=message):
        train(flat_config(output_dir=str(tmp_path / "run"), steps=1, **{**TINY, **change}))


def test_the_command_line_trains_and_says_where_it_wrote(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "run"
    assert main(["train", "--student", "llama-tiny", "--teacher", "qwen2-tiny", "--prompts", str(prompts),
                 "--steps", "2", "--prompts-per-micro-batch", "2", "--max-new-tokens", "6", "--eval-every", "1",
                 "--output-dir", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "held-out reverse KL to the teacher" in printed and str(out / "metrics.jsonl") in printed
    assert main(["train", "--output-dir", str(out), "--resume", str(tmp_path / "none"), "--teacher",
                 "qwen2-tiny"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_two_zero3_ranks_train_evaluate_and_checkpoint_together(tmp_path):
    """Under torchrun, student and teacher both partitioned (ZeRO-3), each rank its own prompts and sampled
    response widths: the ranks stay in lockstep through rollouts, teacher caches and evaluations, write one
    metrics file (rank 0), a checkpoint with both ranks' partitions, and the whole student into model/."""
    import sys

    from conftest import clean_env, run_named
    from opsd_rollout.distributed import free_port

    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "opsd_rollout", "train", "--student", "llama-tiny",
               "--teacher", "qwen2-tiny", "--steps", "3", "--prompts-per-micro-batch", "2", "--max-new-tokens", "8",
               "--eval-every", "3", "--eval-prompts", "8", "--zero-stage", "3", "--teacher-zero-stage", "3",
               "--temperature", "1.0", "--output-dir", str(out), "--quiet"]
    result = run_named("train on 2 ZeRO-3 ranks (about 15 s on 2 quiet cores)", command,
                       env={**clean_env(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("held-out reverse KL") == 1  # rank 0 speaks
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in records(out)[1:])  # DeepSpeed's, over the partitioned gradients
    assert sorted(p.name for p in (out / "checkpoints" / "step3").glob("*model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    from opsd_rollout.models import PRESETS, load_model

    model, _ = load_model(str(out / "model"))
    assert sum(p.numel() for p in model.parameters()) == PRESETS["llama-tiny"].num_parameters()  # gathered whole


def test_the_progress_line_gives_a_rollout_share_only_to_steps_that_rolled_out(tmp_path, capsys):
    """SFT's progress line said ``rollout 0%`` on every line: its steps roll nothing out."""
    from opsd_rollout.train.report import Progress

    train(flat_config(output_dir=str(tmp_path / "sft"), objective="sft", student="llama-tiny", steps=2,
                      prompts=str(write_prompts(tmp_path / "p.jsonl")), prompts_per_micro_batch=2, max_new_tokens=6,
                      eval_every=1, eval_prompts=2, progress=True))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and not any("rollout" in line for line in lines), lines
    rolled = {"step": 1, "loss": 0.5, "tokens_per_second": 10.0, "time/rollout_ms": 30.0, "time/rollout_share": 0.6}
    assert "rollout 60%" in Progress(2, 0).line(rolled)
