"""A reference is a whole response unless its record says it is running text: every path that trains on references
(``--objective sft``, the off-policy steps of ``--lmbda`` < 1, the held-out cross-entropy) trains the tokenizer's EOS
after a whole response, exactly once, and nothing after a continuation (``"continuation": true``, the built-in
corpus's windows); a student SFT'd on a few references from a file learns to stop where they end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opsd_rollout.models import EOS_ID, PAD_ID, byte_tokenizer
from opsd_rollout.opsd.targets import response_targets
from opsd_rollout.train import TrainConfig, read_examples, train
from opsd_rollout.train.data import Encoder

CPU = torch.device("cpu")
PAIRS = [("Colour of the sky?", " blue"), ("Two plus two?", " 4, of course"), ("Name a fruit.", " a pear")]


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ids(text: str) -> list[int]:
    return byte_tokenizer()(text, add_special_tokens=False)["input_ids"]


def trained_labels(batch) -> list[list[int]]:
    """Per row, the tokens the loss trains on: the targets under the response mask."""
    targets = response_targets(batch)
    return [row[mask].tolist() for row, mask in zip(targets.labels, targets.mask)]


def test_a_whole_response_trains_its_eos_exactly_once_and_a_continuation_none(tmp_path):
    path = write(tmp_path / "p.jsonl", [
        {"prompt": "Colour of the sky?", "reference": " blue"},
        {"prompt": "Two plus two?", "reference": " 4</s>"},  # written with the EOS's text: not doubled
        {"prompt": "Once upon a", "reference": " time there", "continuation": True},
        {"prompt": "Count:", "completion": " 1 2 3 4 5 6 7 8 9"},  # longer than the window: cut, it did not end
    ])
    examples = read_examples(path, byte_tokenizer())
    assert [e.eos for e in examples] == [True, True, False, True]
    batch = Encoder(byte_tokenizer(), max_prompt_tokens=64, max_reference_tokens=12).with_references(
        examples, CPU, samples=2)
    rows = trained_labels(batch)
    assert rows[0] == rows[1] == ids(" blue") + [EOS_ID]
    assert rows[2] == ids(" 4") + [EOS_ID]
    assert rows[4] == ids(" time there")
    assert rows[6] == ids(" 1 2 3 4 5 6 7 8 9")[:12]
    assert [row.count(EOS_ID) for row in rows] == [1, 1, 1, 1, 0, 0, 0, 0]


def test_the_documented_examples_of_each_kind_train_what_the_docs_say(tmp_path):
    """docs/TRAINING.md's two lines under "How a reference ends": the whole response trains its EOS after
    ``#### 605``, the continuation its own tokens alone."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "TRAINING.md").read_text()
    block = text.split("**How a reference ends**", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    path = tmp_path / "documented.jsonl"
    path.write_text("\n".join(line.strip() for line in block.strip().splitlines()) + "\n")
    whole, running = read_examples(path, byte_tokenizer())
    batch = Encoder(byte_tokenizer(), max_prompt_tokens=64, max_reference_tokens=80).with_references(
        [whole, running], CPU)
    first, second = trained_labels(batch)
    assert byte_tokenizer().decode(first).endswith("#### 605</s>") and first.count(EOS_ID) == 1
    assert byte_tokenizer().decode(second) == " over the items of any sequence"


@pytest.mark.parametrize("record,message", [
    ({"prompt": "a", "reference": "b", "continuation": "yes"}, "line 2: 'continuation' must be true or false; got "
                                                              "'yes'"),
    ({"prompt": "a", "continuation": True}, "line 2: 'continuation' says how a reference ends, and the line has no "
                                            "'reference'"),
])
def test_a_bad_continuation_is_refused_with_its_line(tmp_path, record, message):
    path = write(tmp_path / "p.jsonl", [{"prompt": "x", "reference": "y"}, record])
    with pytest.raises(ValueError, match=message):
        read_examples(path, byte_tokenizer())


def test_the_built_in_corpus_windows_are_running_text():
    from opsd_rollout.train.corpus import corpus_examples

    train_examples, held_out = corpus_examples()
    assert not any(e.eos for e in train_examples + held_out)
    batch = Encoder(byte_tokenizer(), max_prompt_tokens=64, max_reference_tokens=32).with_references(
        train_examples[:4], CPU)
    assert all(EOS_ID not in row and len(row) == 32 for row in trained_labels(batch))


def tiny_run(tmp_path: Path, name: str, **values) -> list[dict]:
    path = write(tmp_path / "pairs.jsonl", [{"prompt": p, "reference": r} for p, r in PAIRS])
    config = dict(output_dir=str(tmp_path / name), student="llama-tiny", prompts=str(path),
                  prompts_per_micro_batch=len(PAIRS), max_new_tokens=16, progress=False, lr=1e-3, seed=0)
    return train(TrainConfig.from_flat({**config, **values}))


def test_sft_off_policy_steps_and_the_held_out_cross_entropy_train_the_eos(tmp_path):
    """A micro-batch of the three examples (each step takes all of them) trains their tokens and one EOS each,
    under SFT and on the off-policy steps; the step-0 cross-entropy on the held-out references (the same three:
    a file of fewer than ten examples) is the initial student's over the references and their EOS."""
    from opsd_rollout.models import load_model
    from opsd_rollout.modeling import position_ids

    tokens = sum(len(ids(r)) + 1 for _, r in PAIRS)
    sft = tiny_run(tmp_path, "sft", objective="sft", steps=2, eval_every=2).records
    assert [r["response_tokens"] for r in sft if "loss" in r] == [tokens, tokens]
    off_policy = tiny_run(tmp_path, "kd", teacher="qwen2-tiny", lmbda=0.0, steps=1, eval_every=1).records
    assert [r["response_tokens"] for r in off_policy if "loss" in r] == [tokens]

    model, tokenizer = load_model("llama-tiny")  # the student before any step
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, reference in PAIRS:
            sequence = torch.tensor([ids(prompt) + ids(reference) + [EOS_ID]])
            logits = model(input_ids=sequence, position_ids=position_ids(torch.ones_like(sequence))).logits[0]
            start = len(ids(prompt))
            losses = torch.nn.functional.cross_entropy(logits[start - 1:-1].float(), sequence[0, start:],
                                                       reduction="none")
            total, count = total + float(losses.sum()), count + losses.numel()
    assert sft[0]["eval_cross_entropy"] == pytest.approx(total / count, rel=1e-4)
    assert off_policy[0]["eval_cross_entropy"] == pytest.approx(total / count, rel=1e-4)


def test_a_student_sft_on_a_prompt_file_stops_where_the_reference_ends(tmp_path):
    """Greedy, the student writes each reference, then its EOS, then nothing: the window (16 tokens) has room for
    more, which a student that never learnt to stop would fill."""
    from opsd_rollout import HybridEngineRollout, SamplingConfig
    from opsd_rollout.models import load_model
    from opsd_rollout.train.data import Example

    result = tiny_run(tmp_path, "sft", objective="sft", steps=60, lr=1e-2, eval_every=60)
    model, tokenizer = load_model(str(result.model_dir))
    encoder = Encoder(tokenizer, max_prompt_tokens=64, max_reference_tokens=16)
    rollout = HybridEngineRollout(model.eval(), tokenizer)
    with torch.no_grad():
        batch = rollout.generate(encoder.request([Example(p) for p, _ in PAIRS], CPU),
                                 SamplingConfig(max_new_tokens=16, temperature=0.0))
    start = int(batch.response_start_idx[0])
    for row, (_, reference) in zip(batch.input_ids[:, start:].tolist(), PAIRS):
        expected = ids(reference) + [EOS_ID]
        assert row == expected + [PAD_ID] * (len(row) - len(expected)), tokenizer.decode(row)
