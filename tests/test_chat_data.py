"""Multi-turn chat data: ``messages`` rendered with the tokenizer's own chat template; after a last user or tool turn
the rollout generates a new assistant turn, a last assistant turn it continues; every earlier turn is prompt, never
trained on (the loss mask checked token by token, on the student's samples and on references); a record whose last
turn is anything else is refused with its line number."""

from __future__ import annotations

import json

import pytest
import torch

from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig, SamplingConfig
from opsd_rollout.models import EOS_ID, PAD_ID, byte_tokenizer, load_model
from opsd_rollout.opsd.targets import response_targets
from opsd_rollout.train import Example, read_examples
from opsd_rollout.train.data import Encoder

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen's ChatML turns, as a tokenizer's chat template."""
CONVERSATION = [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "Let me check."},
                {"role": "tool", "content": "4"},
                {"role": "user", "content": "So?"}]
PREFIX = {"role": "assistant", "content": "It is"}


@pytest.fixture
def chat_tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_turns_render_with_the_tokenizers_template(tmp_path, chat_tokenizer):
    path = write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, {"messages": [*CONVERSATION, PREFIX]},
                                           {"messages": CONVERSATION, "reference": "4", "teacher": "math"}])
    new_turn, continued, with_reference = read_examples(path, chat_tokenizer)
    assert new_turn == Example(chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                                  add_generation_prompt=True))
    assert new_turn.prompt.endswith("<|im_start|>user\nSo?<|im_end|>\n<|im_start|>assistant\n")
    assert continued.prompt == chat_tokenizer.apply_chat_template([*CONVERSATION, PREFIX], tokenize=False,
                                                                  continue_final_message=True)
    assert continued.prompt.endswith("<|im_start|>assistant\nIt is")  # open: the student continues the turn
    # the reference is the rest of the turn as the template closes it, which ends it: no EOS after it
    assert with_reference == Example(new_turn.prompt, "4<|im_end|>\n", "math", eos=False)


def test_without_a_template_turns_are_role_lines(tmp_path):
    path = write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[:2]}, {"messages": [*CONVERSATION[:2], PREFIX],
                                                                             "reference": " 4."}])
    assert read_examples(path, byte_tokenizer()) == [
        Example("system: Answer with a number.\nuser: What is 2+2?\nassistant: "),
        Example("system: Answer with a number.\nuser: What is 2+2?\nassistant: It is", " 4.")]


@pytest.mark.parametrize("record,message", [
    ({"messages": [*CONVERSATION, {"role": "system", "content": "late"}]}, "line 2: the last message is the 'system' "
                                                                          "turn; a chat record ends with the user's"),
    ({"messages": []}, "line 2: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "line 2: message 0 must be a {'role': text, 'content': text} object"),
    ({"messages": CONVERSATION, "reference": ["4"]}, "line 2: 'reference' must be text"),
    ({"messages": CONVERSATION, "teacher": ""}, "line 2: 'teacher' must be a teacher's name"),
])
def test_a_record_that_ends_where_nothing_follows_is_refused_with_its_line(tmp_path, chat_tokenizer, record, message):
    path = write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, record])
    with pytest.raises(ValueError, match="chat.jsonl' " + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("{", r"\{").replace("}", r"\}").replace("[", r"\[")):
        read_examples(path, chat_tokenizer)


def trained_tokens(batch) -> list[list[int]]:
    """Per row and per sequence position: 1 where the loss trains on the token there (a target of the response
    window with mask 1), else 0."""
    targets = response_targets(batch)
    trained = torch.zeros(batch.input_ids.shape, dtype=torch.int64)
    trained[:, targets.prompt_length:targets.prompt_length + targets.mask.shape[1]] = targets.mask.long()
    return trained.tolist()


def test_the_loss_trains_on_the_students_own_tokens_alone_token_by_token(tmp_path, chat_tokenizer):
    """A sampled rollout of a new turn and of a continued one: every token of every earlier turn (system, user,
    assistant, tool), the turn's opening and the assistant prefix, and every pad, is untrained; each token the
    student generated, up to and including its EOS, is trained."""
    path = write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, {"messages": [*CONVERSATION, PREFIX]}])
    examples = read_examples(path, chat_tokenizer)
    encoder = Encoder(chat_tokenizer, max_prompt_tokens=512, max_reference_tokens=8)
    request = encoder.request(examples, torch.device("cpu"))
    model, _ = load_model("llama-tiny")
    with torch.no_grad():  # an EOS likely within the window, so rows end at different places
        model.lm_head.weight[EOS_ID] += 0.25 * model.lm_head.weight.norm(dim=1).mean()
    rollout = HybridEngineRollout(model, chat_tokenizer, HybridEngineRolloutConfig())
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=12, n_samples_per_prompt=2, temperature=1.0),
                             seed=3)
    width = request.prompt_ids.shape[1]
    for row, trained in enumerate(trained_tokens(batch)):
        example = examples[row // 2]
        ids = batch.input_ids[row].tolist()
        prompt_ids = chat_tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        generated = ids[width:]
        ended = generated.index(EOS_ID) + 1 if EOS_ID in generated else len(generated)
        expected = [0] * width + [1] * ended + [0] * (len(generated) - ended)
        assert trained == expected, row
        assert ids[width - len(prompt_ids):width] == prompt_ids and set(ids[:width - len(prompt_ids)]) <= {PAD_ID}
        assert chat_tokenizer.decode(ids[width - len(prompt_ids):width]) == example.prompt  # the whole conversation
    assert any(EOS_ID in batch.input_ids[r, width:].tolist() for r in range(4))  # some row ended early


def test_the_loss_trains_on_the_reference_alone_token_by_token(tmp_path, chat_tokenizer):
    """Off-policy steps and SFT on a multi-turn record: the trained tokens are exactly the reference, the rest of the
    assistant turn as the template closes it; the conversation before it, the prefix included, is not."""
    path = write(tmp_path / "chat.jsonl", [{"messages": [*CONVERSATION, PREFIX], "reference": " 4."},
                                           {"messages": CONVERSATION, "reference": "4"}])
    examples = read_examples(path, chat_tokenizer)
    encoder = Encoder(chat_tokenizer, max_prompt_tokens=512, max_reference_tokens=64)
    batch = encoder.with_references(examples, torch.device("cpu"))
    width = int(batch.response_start_idx[0])
    for row, (trained, example) in enumerate(zip(trained_tokens(batch), examples)):
        ids = batch.input_ids[row].tolist()
        reference = chat_tokenizer(example.reference, add_special_tokens=False)["input_ids"]
        assert trained == [0] * width + [1] * len(reference) + [0] * (len(ids) - width - len(reference))
        assert chat_tokenizer.decode([t for t, on in zip(ids, trained) if on]) == example.reference
    assert [e.reference for e in examples] == [" 4.<|im_end|>\n", "4<|im_end|>\n"]


EOS_TURNS = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% if m.role == 'assistant' %}</s>{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
"""A template that closes an assistant turn with the EOS's own text (as Llama 2's and Mistral's do)."""


@pytest.mark.parametrize("template,continuation,reference,expected", [
    (CHATML, False, "4", "4<|im_end|>\n"),  # the template's end of turn, no EOS after it
    (EOS_TURNS, False, "4", "4</s>"),  # the template's end of turn is the EOS: once, not doubled
    (None, False, " 4.", " 4.</s>"),  # role lines close no turn: the EOS ends it
    (CHATML, True, " 4", " 4"),  # running text: the turn left open, nothing after it
    (None, True, " 4", " 4"),
])
def test_a_chat_reference_ends_its_turn_once_unless_it_is_a_continuation(tmp_path, template, continuation,
                                                                          reference, expected):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    record = {"messages": [*CONVERSATION, PREFIX], "reference": reference}
    (example,) = read_examples(write(tmp_path / "chat.jsonl", [{**record, "continuation": continuation}]), tokenizer)
    batch = Encoder(tokenizer, max_prompt_tokens=512, max_reference_tokens=64).with_references([example],
                                                                                               torch.device("cpu"))
    targets = response_targets(batch)
    trained = targets.labels[0][targets.mask[0]].tolist()
    assert trained == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert trained.count(EOS_ID) == expected.count("</s>")


def test_train_takes_a_multi_turn_file(tmp_path):
    """A run on chat records (the presets' tokenizer has no template: role lines): its off-policy steps train on the
    references' tokens and the EOS after each alone (1 + 3 of them, 2 EOS), its held-out evaluation samples the
    student's continuations."""
    from opsd_rollout.train import TrainConfig, train

    path = write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION, "reference": "4"},
                                           {"messages": [*CONVERSATION, PREFIX], "reference": " 4."}])
    result = train(TrainConfig.from_flat(dict(output_dir=str(tmp_path / "run"), student="llama-tiny",
                                              teacher="qwen2-tiny", prompts=path, steps=1, lmbda=0.0,
                                              prompts_per_micro_batch=2, max_new_tokens=8, eval_prompts=2,
                                              progress=False)))
    assert result.records[1]["response_tokens"] == 1 + 3 + 2 and not result.records[1]["on_policy"]
    assert result.records[0]["eval_reverse_kl"] > 0
