"""Task evaluation: the eval file checked whole (each bad input one line), and the evaluator's counts on a model
whose completions are known (a transition model over the byte tokenizer: greedy accuracy, unextractable answers,
pass@1 and pass@K from the samples, generated tokens), repeatable from its seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import chain_table
from opsd_rollout import HybridEngineRollout, SamplingConfig
from opsd_rollout.models import BYTE_OFFSET, EOS_ID, VOCAB_SIZE, byte_tokenizer
from opsd_rollout.train.eval_file import TaskEvalConfig, read_eval_file
from opsd_rollout.train.scorers import pass_at_k
from opsd_rollout.train.task_eval import evaluate_task, render_problems


def byte(char: str) -> int:
    return BYTE_OFFSET + ord(char)


PROBLEMS = [("What is 6*7? =", 42), ("Name a letter ?", 3), ("Count !", 7)]
"""Prompts by their last character, and answers: greedy ``=`` -> "42" (right), ``?`` -> "x" (no number), ``!`` ->
"5" (wrong); sampled, ``=`` gives "42" or "5" about equally."""


def known_model(*, coin: bool = False) -> torch.nn.Module:
    """A model of the byte tokenizer's vocabulary whose next token is a function of the current one (conftest's
    ``transition_model``, one width wider: RoPE wants an even head): ``=`` -> 4 -> 2 -> EOS, ``?`` -> x -> EOS,
    ``!`` -> 5 -> EOS; with ``coin``, ``=`` -> 4 or 5 (4's logit a hair higher: greedy takes it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    table = chain_table(VOCAB_SIZE, {byte("="): byte("4"), byte("4"): byte("2"), byte("2"): EOS_ID,
                                     byte("?"): byte("x"), byte("x"): EOS_ID, byte("!"): byte("5"),
                                     byte("5"): EOS_ID})
    width = VOCAB_SIZE + 1
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=width, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=width, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-6, eos_token_id=EOS_ID, pad_token_id=0,
                         bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB_SIZE, width))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        head = torch.zeros(VOCAB_SIZE, width)
        head[torch.tensor(table), torch.arange(VOCAB_SIZE)] = 20 / width**0.5
        if coin:
            head[byte("5"), byte("=")] = head[byte("4"), byte("=")] - 1e-3
        model.lm_head.weight.copy_(head)
    return model


@pytest.fixture(scope="module")
def known_checkpoint(tmp_path_factory) -> str:
    """A checkpoint directory of ``known_model`` with the byte tokenizer, for what loads a model by its path (``eval
    --model``, ``train --teacher``)."""
    directory = tmp_path_factory.mktemp("known") / "model"
    known_model().save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return str(directory)


def write_eval(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def problems_file(tmp_path: Path) -> Path:
    return write_eval(tmp_path / "eval.jsonl", [{"prompt": p, "answer": a} for p, a in PROBLEMS])


def run(model, path: Path, samples: int = 1, seed: int = 7, batch_size: int = 2):
    tokenizer = byte_tokenizer()
    config = TaskEvalConfig(data=str(path), scorer="last-number", samples=samples)
    problems = render_problems(read_eval_file(path, "last-number"), tokenizer, max_prompt_tokens=200)
    rollout = HybridEngineRollout(model, tokenizer)
    return evaluate_task(model, rollout, tokenizer, problems, config, SamplingConfig(max_new_tokens=6, top_k=0),
                         max_new_tokens=6, seed=seed, batch_size=batch_size)


# ---- the evaluator ------------------------------------------------------------------------------------------------

def test_greedy_accuracy_and_unextractable_answers_are_counted(tmp_path):
    result = run(known_model(), problems_file(tmp_path))
    assert [p.completion for p in result.problems] == ["42", "x", "5"]
    assert [p.greedy for p in result.problems] == ["42", None, "5"]
    assert [p.line for p in result.problems] == [1, 2, 3]
    assert result.accuracy == pytest.approx(1 / 3) and result.unextractable == 1
    assert result.generated_tokens == 3 + 2 + 2  # EOS counted, padding not
    assert result.pass_at_1 is None and result.pass_at_k is None
    assert not any(key.startswith(("pass@", "sampled")) for key in result.to_dict())  # K = 1: greedy alone
    assert result.record() == {"eval_accuracy": pytest.approx(1 / 3), "eval_unextractable": 1}
    assert result.tokens_per_second == pytest.approx(result.generated_tokens / result.seconds)


def test_pass_at_k_from_the_samples(tmp_path):
    """K = 8 samples: "42" or "5" for the first problem, "x" (no answer) for the second, "5" (wrong) for the third;
    pass@1 is the mean of c/K and pass@8 the unbiased estimate from each problem's c."""
    result = run(known_model(coin=True), problems_file(tmp_path), samples=8)
    first, second, third = result.problems
    assert first.greedy == "42" and result.accuracy == pytest.approx(1 / 3)  # greedy takes the higher logit
    assert 0 < first.correct < 8  # both outcomes drawn (from this seed)
    assert (second.correct, second.unextractable, third.correct, third.unextractable) == (0, 8, 0, 0)
    assert result.pass_at_1 == pytest.approx(first.correct / 8 / 3)
    assert result.pass_at_k == pytest.approx(pass_at_k(8, first.correct, 8) / 3) == pytest.approx(1 / 3)
    assert result.sampled_unextractable == 8
    assert result.generated_tokens == 7 + 3 * first.correct + 2 * (8 - first.correct) + 16 + 16
    record = result.record()
    assert set(record) == {"eval_accuracy", "eval_unextractable", "eval_pass@1", "eval_pass@8"}
    assert set(result.record("teacher_eval_")) == {"teacher_eval_accuracy", "teacher_eval_unextractable",
                                                   "teacher_eval_pass@1", "teacher_eval_pass@8"}
    again = run(known_model(coin=True), problems_file(tmp_path), samples=8, batch_size=3)  # other batches
    assert [p.correct for p in again.problems][1:] == [0, 0]
    same = run(known_model(coin=True), problems_file(tmp_path), samples=8)
    assert same.problems == result.problems  # the same seed, the same samples
    document = json.loads(json.dumps(result.to_dict()))
    assert document["pass@8"] == result.pass_at_k and len(document["per_problem"]) == 3


def test_chat_messages_are_rendered_and_a_long_prompt_refused(tmp_path):
    path = write_eval(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}])
    problem, = render_problems(read_eval_file(path, "exact"), byte_tokenizer(), max_prompt_tokens=100)
    assert problem.example.prompt == "user: hi\nassistant: "  # no chat template: role lines (train's rendering)
    with pytest.raises(ValueError, match="line 1: the prompt has 20 tokens, over the 10 .* --eval-max-new-tokens"):
        render_problems(read_eval_file(path, "exact"), byte_tokenizer(), max_prompt_tokens=10)


# ---- bad input: one line, before any model work ---------------------------------------------------------------------

@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], "line 2: no 'answer'"),
    ([{"answer": "1"}], "line 1: neither a 'prompt' nor 'messages'"),
    ([{"prompt": "", "answer": "1"}], "line 1: 'prompt' must be a non-empty string"),
    ([{"prompt": "a", "answer": ""}], "line 1: 'answer' must be a non-empty string or a number"),
    ([{"prompt": "a", "answer": None}], "line 1: 'answer' must be a non-empty string or a number"),
    ([{"messages": [], "answer": "1"}], "line 1: 'messages' must be a non-empty list"),
    ([{"prompt": "a", "answer": "#### 1"}, {"prompt": "b", "answer": "one"}],
     "line 2: 'answer' \"one\" holds no answer the gsm8k scorer can read \\(1 of 2 such lines"),
    ([{"prompt": "a", "answer": "one"}, {"prompt": "b", "answer": "two"}],
     "no 'answer' holds one the gsm8k scorer can read \\(line 1: \"one\"\\): pick the scorer of the answers' format "
     "\\(boxed, last-number, exact\\)"),
])
def test_a_bad_eval_file_is_one_line_naming_it(tmp_path, rows, message):
    path = write_eval(tmp_path / "x.jsonl", rows)
    with pytest.raises(ValueError, match=message) as error:
        read_eval_file(path, "gsm8k")
    assert str(error.value).startswith(f"--eval-data '{path}'") and "\n" not in str(error.value)


def test_a_missing_empty_or_non_json_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_eval_file(tmp_path / "none.jsonl", "exact")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no problem"):
        read_eval_file(tmp_path / "empty.jsonl", "exact")
    (tmp_path / "text.jsonl").write_text("what is 2+2?\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_eval_file(tmp_path / "text.jsonl", "exact")


def test_numbers_and_worked_solutions_are_answers(tmp_path):
    path = write_eval(tmp_path / "g.jsonl", [{"prompt": "a", "answer": 72}, {"prompt": "b", "answer": "so\n#### 1,000"},
                                             {"prompt": "c", "answer": 2.50}])
    assert [r.answer for r in read_eval_file(path, "gsm8k")] == ["72", "1000", "2.5"]


@pytest.mark.parametrize("fields, message", [
    (dict(data="x.jsonl", scorer="math"), "--eval-scorer: unknown scorer 'math'; known: gsm8k, boxed, last-number"),
    (dict(data="x.jsonl", scorer="gsm8k", samples=0), "--eval-samples must be an int >= 1"),
    (dict(data="x.jsonl", scorer="gsm8k", samples=-3), "--eval-samples must be an int >= 1"),
    (dict(data="x.jsonl"), "--eval-data needs --eval-scorer"),
    (dict(scorer="gsm8k"), "--eval-scorer needs --eval-data"),
    (dict(samples=4), "--eval-samples or --eval-max-new-tokens needs --eval-data and --eval-scorer"),
    (dict(data="x.jsonl", scorer="gsm8k", max_new_tokens=0), "--eval-max-new-tokens must be an int >= 1"),
])
def test_bad_task_eval_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(")):
        TaskEvalConfig(**fields)
