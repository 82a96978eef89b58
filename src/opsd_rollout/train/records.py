"""A prompt file's records, read and checked without a tokenizer: light (no torch, transformers or DeepSpeed), so
the command line refuses a bad file, naming its line, before any of them loads.

A file is JSON lines or plain text (one prompt a line, when it is neither ``.jsonl``/``.json`` nor starts with
``{``). A JSON record has a ``prompt`` (text) or chat ``messages``, and optionally a ``reference`` (``completion``
is read as a synonym: the text that continues the prompt), ``continuation`` and a ``teacher`` (the name of the
teacher that scores it, with several teachers).

A reference is a whole response: training on it trains the end after it too (the tokenizer's EOS; a chat turn's
end-of-turn text), so the model learns to stop there. ``"continuation": true`` says a reference is running text
that does not end there (a window of a document): nothing is trained after it.

Chat ``messages`` are a list of ``{"role": ..., "content": ...}`` turns (``system``, ``user``, ``assistant``,
``tool``, or any role the tokenizer's chat template knows). The last turn says what the rollout does: after a
``user`` (or ``tool``) turn it generates a new assistant turn; after an ``assistant`` turn it continues that turn
(a prefix the student completes). Any other last turn is refused: there is nothing to generate after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATE_AFTER = ("user", "tool")
"""Last roles after which the rollout generates a new assistant turn."""
CONTINUE = "assistant"
"""The last role whose turn the rollout continues."""


@dataclass(frozen=True)
class Record:
    """One example of a prompt file, as written (``Example``, in ``data.py``, is it rendered with a tokenizer)."""

    line: int
    """Its line in the file (1-based, counting blank lines), for messages about it."""
    prompt: str | None = None
    """The prompt text (``None`` for a chat record)."""
    messages: tuple[dict[str, Any], ...] | None = None
    """The chat turns (``None`` for a text record)."""
    reference: str | None = None
    """What continues the prompt: a text record's next text, a chat record's rest of the assistant turn."""
    teacher: str | None = None
    """The teacher that scores this example (its name with several teachers); ``None``: the default teacher."""
    continuation: bool = False
    """The reference is running text that does not end where it stops (``"continuation": true``); ``False``: a whole
    response, whose end is trained after it."""


def read_records(path: str | Path) -> list[Record]:
    """Every record of a prompt file, checked; a ``ValueError`` naming the file and the line for a missing or
    empty file, a line that is not JSON, a record with neither ``prompt`` nor ``messages``, a chat turn that is
    not ``{"role", "content"}``, or a chat record whose last turn is neither the user's (or a tool's) nor an
    assistant prefix to continue."""
    path = Path(path)
    lines = numbered_lines(path, "--prompts", "prompt")
    if path.suffix not in (".jsonl", ".json") and not lines[0][1].lstrip().startswith("{"):
        return [Record(number, prompt=line) for number, line in lines]
    return [_record(f"--prompts {str(path)!r} line {number}", number, line) for number, line in lines]


def numbered_lines(path: Path, flag: str, what: str) -> list[tuple[int, str]]:
    """A data file's non-blank lines, each with its number (1-based, blank lines counted); a ``ValueError`` naming
    ``flag`` and the file when it is missing or holds no line (no ``what``: a prompt, a problem)."""
    if not path.is_file():
        raise ValueError(f"{flag} {str(path)!r} does not exist (or is not a file)")
    lines = [(number, line) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    if not lines:
        raise ValueError(f"{flag} {str(path)!r} holds no {what}")
    return lines


def _record(where: str, number: int, line: str) -> Record:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON: {error}") from None
    if not isinstance(value, dict) or not ("prompt" in value or "messages" in value):
        raise ValueError(f"{where} has neither a 'prompt' nor 'messages' field")
    reference = value.get("reference", value.get("completion"))
    if reference is not None and not isinstance(reference, str):
        raise ValueError(f"{where}: 'reference' must be text; got {type(reference).__name__}")
    teacher = value.get("teacher")
    if teacher is not None and (not isinstance(teacher, str) or not teacher):
        raise ValueError(f"{where}: 'teacher' must be a teacher's name; got {teacher!r}")
    continuation = value.get("continuation", False)
    if not isinstance(continuation, bool):
        raise ValueError(f"{where}: 'continuation' must be true or false; got {continuation!r}")
    if continuation and reference is None:
        raise ValueError(f"{where}: 'continuation' says how a reference ends, and the line has no 'reference'")
    if "messages" in value:
        return Record(number, messages=check_messages(value["messages"], where), reference=reference,
                      teacher=teacher, continuation=continuation)
    prompt = str(value["prompt"])
    if not prompt:
        raise ValueError(f"{where} has an empty prompt")
    return Record(number, prompt=prompt, reference=reference, teacher=teacher, continuation=continuation)


def check_messages(messages: Any, where: str = "messages") -> tuple[dict[str, Any], ...]:
    """Chat turns checked: a non-empty list of ``{"role": text, "content": text}`` (an assistant turn that calls
    tools may have ``tool_calls`` and no content), the last one a user's or a tool's (a new assistant turn follows)
    or an assistant's (continued)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and (isinstance(message.get("content"), str) or "tool_calls" in message)):
            raise ValueError(f"{where}: message {index} must be a {{'role': text, 'content': text}} object; got "
                             f"{message!r:.80}")
    last = messages[-1]["role"]
    if last not in (*GENERATE_AFTER, CONTINUE):
        raise ValueError(f"{where}: the last message is the {last!r} turn; a chat record ends with the user's turn "
                         "(or a tool's result), after which a new assistant turn is generated, or with an assistant "
                         "turn to continue (its prefix)")
    return tuple(messages)
