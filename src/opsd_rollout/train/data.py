"""Training data: prompts (with optional reference text) from a file or the built-in corpus, and the
deterministic order the loop takes them in.

A prompt file is JSON lines with a ``prompt`` field (or chat ``messages``) and an optional ``reference`` (the text
the prompt should continue with; ``completion`` is read as a synonym), or plain text with one prompt a line. The
order is a function of the seed and the micro-batch's index alone, so a resumed run takes exactly the batches the
uninterrupted run would have.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepspeed.runtime.rollout.base import RolloutBatch, RolloutRequest


@dataclass(frozen=True)
class Example:
    prompt: str
    reference: str | None = None
    """The text that follows the prompt in the data (SFT's target, supervised KD's references)."""
    eos: bool = False
    """The reference is a whole response (a built-in task's worked solution), not a window of running text:
    training on it trains the tokenizer's EOS after it too, so the model learns to stop."""


def render_messages(messages: list[dict[str, str]], tokenizer: Any) -> Example:
    """Chat ``messages`` as a prompt: the tokenizer's chat template when it has one (with the generation prompt),
    else ``role: content`` lines. A last ``assistant`` message is the reference, not part of the prompt."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    reference = None
    if messages[-1]["role"] == "assistant" and len(messages) > 1:
        reference, messages = messages[-1]["content"], messages[:-1]
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return Example(prompt, reference)


def read_examples(path: str | Path, tokenizer: Any) -> list[Example]:
    """Every example of a prompt file (see the module docstring); a clear error for a missing or empty file or a
    line that is not an example."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r} does not exist (or is not a file)")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts {str(path)!r} holds no prompt")
    if path.suffix not in (".jsonl", ".json") and not lines[0].lstrip().startswith("{"):
        return [Example(line) for line in lines]
    examples = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--prompts {str(path)!r} line {number} is not JSON: {error}") from None
        if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
            raise ValueError(f"--prompts {str(path)!r} line {number} has neither a 'prompt' nor 'messages' field")
        if "messages" in record:
            example = render_messages(record["messages"], tokenizer)
        else:
            example = Example(str(record["prompt"]), record.get("reference", record.get("completion")))
        if not example.prompt:
            raise ValueError(f"--prompts {str(path)!r} line {number} has an empty prompt")
        examples.append(example)
    return examples


@functools.lru_cache(maxsize=4)
def order(count: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The examples' order in ``epoch``: a permutation from (seed, epoch) alone."""
    return tuple(int(i) for i in np.random.default_rng([seed, epoch]).permutation(count))


def batch_indices(count: int, batch_size: int, seed: int, micro_batch: int) -> list[int]:
    """The examples of global micro-batch ``micro_batch``: the next ``batch_size`` of the shuffled stream of
    epochs (a batch may span two epochs)."""
    start = micro_batch * batch_size
    indices = []
    for position in range(start, start + batch_size):
        epoch, index = divmod(position, count)
        indices.append(order(count, seed, epoch)[index])
    return indices


class Encoder:
    """Token ids of prompts (left-padded) and references (right-padded) for one tokenizer."""

    def __init__(self, tokenizer: Any, *, max_prompt_tokens: int, max_reference_tokens: int):
        self.tokenizer = tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_prompt_tokens, self.max_reference_tokens = max_prompt_tokens, max_reference_tokens

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def request(self, examples: list[Example], device: torch.device) -> RolloutRequest:
        """[B, P] left-padded prompts, each cut to its last ``max_prompt_tokens`` tokens."""
        rows = [self.ids(e.prompt)[-self.max_prompt_tokens:] or [self.pad] for e in examples]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        return RolloutRequest(ids.to(device), mask.to(device))

    def with_references(self, examples: list[Example], device: torch.device, samples: int = 1) -> RolloutBatch:
        """A ``RolloutBatch`` whose responses are the examples' references (followed by EOS where ``eos``), each cut
        to ``max_reference_tokens``, every row repeated ``samples`` times, as a rollout of ``samples`` per prompt
        returns it."""
        if any(e.reference is None for e in examples):
            raise ValueError("training on references needs a 'reference' for every example")
        request = self.request(examples, device)
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        answers = [(self.ids(e.reference) + (eos if e.eos else []))[:self.max_reference_tokens] for e in examples]
        width = max(1, max(len(a) for a in answers))
        ids = torch.full((len(answers), width), self.pad, dtype=torch.int64)
        mask = torch.zeros((len(answers), width), dtype=torch.int64)
        for i, answer in enumerate(answers):
            ids[i, :len(answer)] = torch.tensor(answer, dtype=torch.int64)
            mask[i, :len(answer)] = 1
        input_ids = torch.cat([request.prompt_ids, ids.to(device)], dim=1).repeat_interleave(samples, dim=0)
        attention = torch.cat([request.prompt_attention_mask, mask.to(device)], dim=1).repeat_interleave(samples, dim=0)
        start = torch.full((input_ids.shape[0],), request.prompt_ids.shape[1], dtype=torch.int64, device=device)
        return RolloutBatch(input_ids=input_ids, attention_mask=attention, response_start_idx=start)
