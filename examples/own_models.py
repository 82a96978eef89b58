"""A student and teacher pair of your own, from your own tokenizer and configs, that ``opsd-rollout train`` accepts
(docs/MODELS.md walks through it). Run: ``python examples/own_models.py my-models`` writes ``my-models/student``,
``my-models/teacher`` (checkpoint directories: weights, config, tokenizer with its chat template) and
``my-models/chat.jsonl`` (chat prompts with references, from the Python documentation that ships with Python).

What ``train`` needs of the pair, each refused before any step when it is missing:
- one tokenizer, saved in both directories: the same tokens at the same ids (``train`` uses the student's);
- ``vocab_size`` = ``len(tokenizer)`` in both configs (added tokens count; ``tokenizer.vocab_size`` may not);
- an EOS that ends a response (here the end-of-turn token, so a response is one assistant turn) and a pad token
  (``train`` uses the EOS when there is none);
- ``max_position_embeddings`` >= the longest prompt + ``--max-new-tokens``;
- a chat template on the tokenizer for chat ``messages`` (without one they become ``role: content`` lines).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SIZES = {"student": dict(hidden_size=64, num_hidden_layers=2), "teacher": dict(hidden_size=128, num_hidden_layers=4)}


def make_tokenizer(texts: list[str], vocab: int = 1024):
    """A byte-level BPE trained on ``texts``, with ChatML's turn markers as special tokens, as a transformers
    tokenizer (what ``save_pretrained`` writes and ``AutoTokenizer`` loads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def make_models(out: Path, tokenizer, sizes: dict = SIZES, positions: int = 512) -> None:
    """Llama student and teacher of ``tokenizer``'s vocabulary with random weights, saved with the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None, max_position_embeddings=positions,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    for name, size in sizes.items():
        config = LlamaConfig(intermediate_size=3 * size["hidden_size"], **size, **common)
        LlamaForCausalLM(config).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)


def write_prompts(path: Path, topics: dict[str, str], count: int = 200, reference_chars: int = 64) -> None:
    """Chat records: a question about a topic, the topic's first characters as the reference answer."""
    with open(path, "w") as handle:
        for title, text in sorted(topics.items())[:count]:
            question = f"What does the Python documentation say about {title}?"
            handle.write(json.dumps({"messages": [{"role": "user", "content": question}],
                                     "reference": text[:reference_chars]}) + "\n")


def main(out: str) -> None:
    from pydoc_data.topics import topics

    root = Path(out)
    tokenizer = make_tokenizer(list(topics.values()))
    make_models(root, tokenizer)
    write_prompts(root / "chat.jsonl", topics)
    print(f"{root}/student, {root}/teacher ({len(tokenizer):,} tokens), {root}/chat.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "my-models")
