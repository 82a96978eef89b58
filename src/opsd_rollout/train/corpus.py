"""The built-in corpus: the Python documentation's topics that ship with every Python (``pydoc_data.topics``,
about 465 KB of English no one here wrote), cut into prompts and the text that follows each, split into train and
held-out examples by topic, so held-out prompts come from pages the model never trained on."""

from __future__ import annotations

import hashlib

from opsd_rollout.train.data import Example

HELD_OUT_EVERY = 10
"""One topic in this many (by a hash of its name, stable across Pythons) is held out."""


def _held_out(topic: str) -> bool:
    return int(hashlib.sha256(topic.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def corpus_examples(*, prompt_chars: int = 48, reference_chars: int = 32,
                    stride: int | None = None) -> tuple[list[Example], list[Example]]:
    """(train, held-out): windows of each topic's text, ``prompt_chars`` of prompt then ``reference_chars`` of
    reference (running text, trained with no EOS after it: a window does not end where it stops), every ``stride``
    characters (default: a window's length, no overlap); whitespace runs collapsed."""
    from pydoc_data.topics import topics

    stride = stride or prompt_chars + reference_chars
    train, held_out = [], []
    for topic in sorted(topics):
        text = " ".join(topics[topic].split())
        windows = [Example(text[i:i + prompt_chars], text[i + prompt_chars:i + prompt_chars + reference_chars],
                           eos=False)
                   for i in range(0, len(text) - prompt_chars - reference_chars + 1, stride)]
        (held_out if _held_out(topic) else train).extend(windows)
    return train, held_out
