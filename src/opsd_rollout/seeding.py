"""``seeded``: torch's default generators started from a seed for one block and put back after it, for what
draws from them and takes no seed or generator of its own (transformers' sampling, dropout, an unseeded rollout's
per-call key): a seeded block leaves the process's random state as it found it. ``seed_of``: the seed of one part
of a run, from the run's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Inside the block, the default generators of the CPU and of ``device`` start from ``seed``; after it they are
    as they were before. ``None``: the block runs on the generators as they are."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def seed_of(seed: int, *key: int) -> int:
    """A seed for one part of a run (a micro-batch, an evaluation), drawn from the run's ``seed`` and the part's
    ``key``: distinct parts get independent streams, the same part the same stream on every rank and resume."""
    return int(np.random.SeedSequence([seed, *key]).generate_state(1)[0])
