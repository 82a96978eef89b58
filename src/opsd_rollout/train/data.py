"""Training data: prompts (with optional reference text) from a file or the built-in corpus, and the
deterministic order the loop takes them in.

A prompt file (``records.py`` reads and checks it, without a tokenizer) is JSON lines with a ``prompt`` field or
chat ``messages`` and an optional ``reference`` (the text the prompt should continue with; ``completion`` is read as
a synonym), or plain text with one prompt a line. Chat messages are rendered with the tokenizer's chat template:
after a last user (or tool) turn with the generation prompt (a new assistant turn follows), a last assistant turn
continued (its text is the prefix the student completes). Every earlier turn is prompt: context the student is
never trained on.

A reference is a whole response unless its record says ``"continuation": true``: a text reference is trained with
the tokenizer's EOS after it, a chat reference with the end-of-turn text its template closes the turn with (the EOS
where the template writes none), so the model learns to stop where the reference ends. A continuation (running
text, like the built-in corpus's windows) is trained on its own tokens alone; a chat one leaves the turn open. The
order is a function of the seed and the micro-batch's index alone, so a resumed run takes
exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from deepspeed.runtime.rollout.base import RolloutBatch, RolloutRequest

from opsd_rollout.train.records import CONTINUE, Record, check_messages, read_records
from opsd_rollout.train.teacher_spec import fill

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Example:
    prompt: str
    reference: str | None = None
    """The text that follows the prompt in the data (SFT's target, supervised KD's references)."""
    teacher: str | None = None
    """The teacher that scores it (a name, with several teachers); ``None``: the default teacher."""
    eos: bool = True
    """Training on the reference trains the tokenizer's EOS after it (once: none is added to a reference whose
    tokens end with it), so the model learns to stop there: a whole response. ``False``: a continuation, running
    text that does not end where the reference stops (the built-in corpus's windows), or a chat reference whose
    template's end-of-turn text already ends it."""
    teacher_prompt: str | None = None
    """The teacher's own prompt, when it is shown another context than the student (its reference: ``in_context``,
    for self-distillation); ``None``: the student's prompt."""


def render_messages(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, reference: str | None = None, *,
                    continuation: bool = False) -> Example:
    """Chat ``messages`` as a prompt, with the tokenizer's chat template (``role: content`` lines when it has
    none): a last user (or tool) turn gets the generation prompt, a last assistant turn is left open to continue
    (``continue_final_message``). ``reference``, when given, is the rest of that assistant turn (or the whole new
    one): rendered as the template closes a turn (its end-of-turn text included), the part after the prompt, with
    the EOS after it where the template writes no end-of-turn text (the ``role: content`` lines); with
    ``continuation``, rendered with the turn left open, and nothing after it."""
    messages = list(check_messages(messages))
    prompt = _render(messages, tokenizer)
    if reference is None:
        return Example(prompt)
    if messages[-1]["role"] == CONTINUE:
        whole = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + reference}]
    else:
        whole = [*messages, {"role": CONTINUE, "content": reference}]
    opened = _render(whole, tokenizer)
    if continuation:
        return Example(prompt, opened[len(prompt):] if opened.startswith(prompt) else reference, eos=False)
    closed = _render(whole, tokenizer, closed=True)
    if not closed.startswith(prompt):
        return Example(prompt, reference)
    # the template's end-of-turn text: what closing the turn adds after it (none, in the role lines)
    end = closed[len(opened):] if closed.startswith(opened) else None
    return Example(prompt, closed[len(prompt):], eos=end is not None and not end.strip())


def _render(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase | None, *,
            closed: bool = False) -> str:
    """The conversation's text: its last assistant turn closed (``closed``), left open, or followed by the
    generation prompt."""
    final = messages[-1]["role"] == CONTINUE
    if final and not closed and not messages[-1].get("content") and len(messages) > 1:
        messages, final = messages[:-1], False  # an empty turn to continue is a new turn to generate
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return cast(str, tokenizer.apply_chat_template(messages, tokenize=False,  # text, not tokens
                                                       add_generation_prompt=not final and not closed,
                                                       continue_final_message=final and not closed))
    lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
    return "\n".join(lines) if final or closed else "".join(line + "\n" for line in lines) + f"{CONTINUE}: "


def example_of(record: Record, tokenizer: PreTrainedTokenizerBase, context: str | None = None) -> Example:
    """A record rendered: a chat record's messages through the tokenizer's template, a text record as it is; with a
    teacher ``context`` (a template of ``{prompt}`` and ``{reference}``), the teacher's prompt too."""
    if record.messages is None:
        example = Example(record.prompt or "", record.reference, record.teacher, eos=not record.continuation)
    else:
        rendered = render_messages(list(record.messages), tokenizer, record.reference, continuation=record.continuation)
        example = Example(rendered.prompt, rendered.reference, record.teacher, eos=rendered.eos)
    if context is None:
        return example
    if record.reference is None:
        raise ValueError(f"line {record.line}: its teacher is shown the reference (--teacher-context, --teacher self), "
                         "and it has no 'reference'")
    return replace(example, teacher_prompt=context_prompt(context, record.prompt or "", record.reference,
                                                          record.messages, tokenizer))


def context_prompt(template: str, prompt: str, reference: str, messages: Any = None,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    """The teacher's prompt: ``template`` filled with the prompt and the reference; for chat ``messages``, the last
    user turn's content filled so (the conversation otherwise the student's, rendered by the same template)."""
    if messages is None:
        return fill(template, prompt=prompt, reference=reference)
    turns = [dict(m) for m in messages]
    last = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=len(turns) - 1)
    turns[last]["content"] = fill(template, prompt=turns[last].get("content") or "", reference=reference)
    return _render(turns, tokenizer)


def in_context(examples: list[Example], context_of: Callable[[str | None], str | None]) -> list[Example]:
    """Text examples (a built-in task's, the corpus's) with their teachers' prompts: ``context_of(example.teacher)``,
    the template of the teacher each goes to (``None``: it sees the student's prompt)."""
    out = []
    for number, example in enumerate(examples, 1):
        context = context_of(example.teacher)
        if context is not None:
            if example.reference is None:
                raise ValueError(f"example {number}: its teacher is shown the reference (--teacher-context, --teacher "
                                 "self), and it has none")
            example = replace(example, teacher_prompt=context_prompt(context, example.prompt, example.reference))
        out.append(example)
    return out


def read_examples(path: str | Path, tokenizer: PreTrainedTokenizerBase,
                  context_of: Callable[[str | None], str | None] | None = None) -> list[Example]:
    """Every example of a prompt file (see the module docstring), with each teacher's prompt where ``context_of``
    (a teacher's name -> its context template, or ``None``) gives a context; a clear error, naming the line, for a
    missing or empty file, a line that is not an example (``records.read_records``), or a line without the reference
    its teacher's context shows."""
    return [example_of(record, tokenizer, context_of(record.teacher) if context_of else None)
            for record in read_records(path)]


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

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, max_prompt_tokens: int, max_reference_tokens: int):
        self.tokenizer = tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_prompt_tokens, self.max_reference_tokens = max_prompt_tokens, max_reference_tokens

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def request(self, examples: list[Example], device: torch.device) -> RolloutRequest:
        """[B, P] left-padded prompts, each cut to its last ``max_prompt_tokens`` tokens."""
        return self._left_padded([self.ids(e.prompt)[-self.max_prompt_tokens:] or [self.pad] for e in examples],
                                 device)

    def teacher_request(self, examples: list[Example], device: torch.device) -> RolloutRequest:
        """[B, P'] the teachers' own prompts, left-padded (an example without one: the student's prompt), whole (a
        run checks before any work that they fit: ``Models.check_prompts``)."""
        return self._left_padded([self.ids(e.teacher_prompt) if e.teacher_prompt is not None
                                  else self.ids(e.prompt)[-self.max_prompt_tokens:] or [self.pad] for e in examples],
                                 device)

    def _left_padded(self, rows: list[list[int]], device: torch.device) -> RolloutRequest:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        return RolloutRequest(ids.to(device), mask.to(device))

    def reference_ids(self, example: Example, eos: list[int]) -> list[int]:
        """The reference's tokens, then ``eos`` (``[the tokenizer's EOS]``, or ``[]``) where the example trains it
        and they do not end with it already (a reference written with the EOS's text)."""
        if example.reference is None:
            raise ValueError(f"an example without a 'reference' has no reference tokens: {example.prompt!r:.80}")
        ids = self.ids(example.reference)
        return ids + eos if example.eos and ids[-1:] != eos else ids

    def with_references(self, examples: list[Example], device: torch.device, samples: int = 1) -> RolloutBatch:
        """A ``RolloutBatch`` whose responses are the examples' references (followed by EOS where ``eos``:
        ``reference_ids``), each cut to ``max_reference_tokens`` (a reference cut there trains no EOS: it did not
        end), every row repeated ``samples`` times, as a rollout of ``samples`` per prompt returns it."""
        if any(e.reference is None for e in examples):
            raise ValueError("training on references needs a 'reference' for every example")
        request = self.request(examples, device)
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        answers = [self.reference_ids(e, eos)[:self.max_reference_tokens] for e in examples]
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
