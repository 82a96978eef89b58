"""docs/MODELS.md's pair of your own models, as a new user builds it (``examples/own_models.py``): a tokenizer
trained on your text with a chat template, Llama configs of its vocabulary, saved as checkpoint directories that
``train`` takes as student and teacher; and the mistakes such a pair can carry refused before any step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from opsd_rollout.train import TrainConfig, train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_models.py"
TINY = {"student": dict(hidden_size=32, num_hidden_layers=1), "teacher": dict(hidden_size=64, num_hidden_layers=2)}


@pytest.fixture(scope="module")
def own():
    spec = importlib.util.spec_from_file_location("own_models", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pair(own, tmp_path_factory):
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("my-models")
    tokenizer = own.make_tokenizer(list(topics.values())[:50], vocab=512)
    own.make_models(root, tokenizer, TINY)
    own.write_prompts(root / "chat.jsonl", topics, count=12)
    return root, tokenizer


def run(root: Path, out: Path, **changes):
    return train(TrainConfig.from_flat({"student": str(root / "student"), "teacher": str(root / "teacher"),
                                        "prompts": str(root / "chat.jsonl"), "output_dir": str(out), "steps": 2,
                                        "prompts_per_micro_batch": 2, "max_new_tokens": 8, "eval_prompts": 2,
                                        "progress": False, **changes}))


def test_your_own_pair_trains(pair, tmp_path):
    root, tokenizer = pair
    config = json.loads((root / "student" / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == 512 and config["eos_token_id"] == tokenizer.eos_token_id
    result = run(root, tmp_path / "run")
    assert [r["step"] for r in result.records] == [0, 1, 2] and result.records[0]["eval_reverse_kl"] > 0
    from opsd_rollout.models import load_model

    student, reloaded = load_model(str(result.model_dir))
    assert reloaded.chat_template == tokenizer.chat_template and reloaded.get_vocab() == tokenizer.get_vocab()
    first = json.loads((root / "chat.jsonl").read_text().splitlines()[0])
    assert first["messages"][-1]["role"] == "user"


def test_a_pair_that_does_not_fit_is_refused_before_any_step(pair, tmp_path, monkeypatch):
    """A model whose vocab_size is under len(tokenizer), and a teacher of the same size whose tokenizer puts other
    tokens at the ids."""
    from transformers import AutoModelForCausalLM

    from opsd_rollout.models import byte_tokenizer
    from opsd_rollout.train import loop

    root, tokenizer = pair
    monkeypatch.setattr(loop, "build_student_engine", lambda *a: pytest.fail("reached the engine"))
    small = tmp_path / "small"
    model = AutoModelForCausalLM.from_pretrained(root / "student")
    model.resize_token_embeddings(400)
    model.save_pretrained(small)
    tokenizer.save_pretrained(small)
    with pytest.raises(ValueError, match="its tokenizer has 512 tokens and its model a vocabulary of 400"):
        run(root, tmp_path / "a", student=str(small), teacher=str(small))
    other = tmp_path / "other"
    AutoModelForCausalLM.from_pretrained(root / "teacher").save_pretrained(other)
    bytes_ = byte_tokenizer()
    bytes_.add_tokens([f"<x{i}>" for i in range(512 - len(bytes_))])
    bytes_.save_pretrained(other)
    with pytest.raises(ValueError) as refused:
        run(root, tmp_path / "b", teacher=str(other))
    assert str(refused.value).startswith(f"the teacher ({other}) and the student ({root / 'student'}) have different "
                                         "tokenizers: ")
    assert "is token" in str(refused.value) and "''s" not in str(refused.value)
