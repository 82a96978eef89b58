"""Held-out evaluation: how close the student is to the teacher where it matters, on its own samples.

``reverse_kl``: the per-token KL(student || teacher), exact over the vocabulary (with a served teacher, the unbiased
k3 estimate from the sampled tokens' log-probabilities), on the student's samples for the held-out prompts (the
quantity on-policy distillation minimises); ``cross_entropy``: the student's per-token cross-entropy on the held-out
references, when the data has them. Both in nats, means over response tokens. The
samples are drawn from a fixed seed at every evaluation (the rollout's own ``seed``, one per chunk of prompts), and
the training's random state is left as it was (``seeded``, for what takes no seed of its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from opsd_rollout.distributed import agree_max, partitioned, several_ranks
from opsd_rollout.modeling import position_ids, text_config
from opsd_rollout.opsd.divergence import DivergenceConfig, token_divergence
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.opsd.targets import expanded_prompts, reprompted, response_targets
from opsd_rollout.opsd.teachers import route_rows, share_targets
from opsd_rollout.opsd.teacher import TeacherCacheConfig
from opsd_rollout.seeding import seeded
from opsd_rollout.train.data import Encoder, Example
from opsd_rollout.train.sft import cross_entropy_sum

REVERSE_KL = DivergenceConfig(loss="reverse_kl")
SAMPLED = TeacherCacheConfig(mode="sampled")
LOGITS_BUDGET = 64 * 2**20
"""Bytes of float32 logits one evaluation forward may hold (student and teacher each): rows are chunked to it."""


def _window_logits(model: torch.nn.Module, targets: Any, rows: slice) -> torch.Tensor:
    """[n, R, V] float32 logits predicting the response tokens of ``rows``."""
    ids, mask = targets.input_ids[rows], targets.attention_mask[rows]
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    return out.logits[:, targets.window].float()


def _row_chunks(targets: Any, vocab: int, *models: torch.nn.Module) -> list[slice]:
    """Rows per forward within ``LOGITS_BUDGET``; where a model is ZeRO-3 partitioned, every rank runs as many
    forwards (the extra ones over row 0, their result unused) so that the gathers meet."""
    per_row = max(1, targets.labels.shape[1] * vocab * 4)
    rows = max(1, LOGITS_BUDGET // per_row)
    chunks = [slice(i, i + rows) for i in range(0, targets.labels.shape[0], rows)]
    if any(partitioned(m) for m in models):
        (count,) = agree_max([len(chunks)], targets.input_ids.device)
        chunks += [slice(0, 0)] * (count - len(chunks))  # an empty slice: a forward of no rows, counted apart
    return chunks


def reverse_kl_sum(student: torch.nn.Module, teacher: torch.nn.Module, batch: Any,
                   scored: Any = None) -> tuple[float, int]:
    """Summed per-token KL(student || teacher) over ``batch``'s response tokens, and their count; ``scored``: what
    the teacher reads when its prompts are not the student's (``targets.reprompted``: the same responses after its
    own prompts)."""
    targets = response_targets(batch)
    theirs = scored if scored is not None else targets
    total, count = 0.0, 0
    for rows in _row_chunks(targets, text_config(student.config).vocab_size, student, teacher):
        if rows.stop == 0:  # another rank's forward: join its gathers
            _window_logits(student, targets, slice(0, 1)), _window_logits(teacher, theirs, slice(0, 1))
            continue
        kl = token_divergence(_window_logits(student, targets, rows), _window_logits(teacher, theirs, rows),
                              REVERSE_KL)  # [n, R], exact over the vocabulary
        mask = targets.mask[rows].to(kl.device)
        total += float((kl * mask).sum())
        count += int(mask.sum())
    return total, count


def served_reverse_kl_sum(student: torch.nn.Module, teacher: ServedTeacher, batch: Any,
                          scored: Any = None) -> tuple[float, int]:
    """Summed per-token KL(student || teacher) over ``batch``'s response tokens, estimated from the sampled tokens
    alone (a served teacher sends log-probabilities, not distributions): k3 = exp(-r) - 1 + r with r = log p_s(y) -
    log p_t(y), whose mean under the student's sampling is the same per-token KL as the exact figure (unbiased,
    never negative), and their count."""
    targets = response_targets(batch)
    teacher_logprobs = teacher.build_cache(scored if scored is not None else targets, SAMPLED).values  # [N, R], host
    total, count = 0.0, 0
    for rows in _row_chunks(targets, text_config(student.config).vocab_size, student):
        logits = _window_logits(student, targets, rows)
        labels = targets.labels[rows].to(logits.device)
        student_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        r = student_logprobs - teacher_logprobs[rows].to(logits.device, torch.float32)
        kl = torch.expm1(-r) + r
        mask = targets.mask[rows].to(kl.device)
        total += float((kl * mask).sum())
        count += int(mask.sum())
    return total, count


def cross_entropy_of(student: torch.nn.Module, batch: Any) -> tuple[float, int]:
    targets = response_targets(batch)
    total, count = 0.0, 0
    for rows in _row_chunks(targets, text_config(student.config).vocab_size, student):
        if rows.stop == 0:
            _window_logits(student, targets, slice(0, 1))
            continue
        logits = _window_logits(student, targets, rows)
        loss, n = cross_entropy_sum(logits, targets.labels[rows], targets.mask[rows].to(logits.device))
        total, count = total + float(loss), count + int(n)
    return total, count


@torch.no_grad()
def evaluate(engine: Any, teacher: Any, rollout: Any, encoder: Encoder, examples: list[Example],
             sampling: Any, *, seed: int, batch_size: int, default_teacher: str | None = None,
             teacher_prompts: bool = False) -> dict[str, float]:
    """``eval_reverse_kl`` (with a teacher) and ``eval_cross_entropy`` (when every example has a reference) of the
    student ``engine`` over ``examples``. Several teachers (``teacher`` a mapping by name): each example's KL to its
    own (its ``teacher`` field's, else ``default_teacher``), also per teacher as ``eval_reverse_kl/NAME``. With
    ``teacher_prompts``, each teacher scores the samples after its own prompt (``Example.teacher_prompt``: shown
    the reference, as it is in training)."""
    module = getattr(engine, "module", engine)
    device = torch.device(getattr(engine, "device", next(module.parameters()).device))
    was_training = module.training
    engine.eval()
    sums = {"eval_reverse_kl": [0.0, 0], "eval_cross_entropy": [0.0, 0]}
    several = isinstance(teacher, Mapping)
    sums.update({f"eval_reverse_kl/{name}": [0.0, 0] for name in (teacher if several else ())})  # alike on every rank
    references = all(e.reference is not None for e in examples)
    try:
        with seeded(seed, device):  # the same samples at every evaluation; training's random state untouched
            for start in range(0, len(examples), batch_size):
                chunk = examples[start:start + batch_size]
                if teacher is not None:
                    batch = rollout.generate(encoder.request(chunk, device), sampling, seed=seed + start)
                    targets = response_targets(batch)
                    scored = None if not teacher_prompts else reprompted(targets, *expanded_prompts(
                        encoder.teacher_request(chunk, device), sampling.n_samples_per_prompt))
                    if not several:
                        _add(sums["eval_reverse_kl"], _reverse_kl(module, teacher, targets, scored))
                    routes = [e.teacher or default_teacher for e in chunk] if several else []
                    rows = route_rows(teacher, routes, sampling.n_samples_per_prompt, batch.input_ids.device) \
                        if several else {}
                    for name, picked in rows.items():
                        if picked.numel():
                            figure = _reverse_kl(module, teacher[name], share_targets(targets, picked),
                                                 None if scored is None else share_targets(scored, picked))
                            _add(sums["eval_reverse_kl"], figure)
                            _add(sums[f"eval_reverse_kl/{name}"], figure)
                if references:
                    _add(sums["eval_cross_entropy"], cross_entropy_of(module, encoder.with_references(chunk, device)))
    finally:
        if was_training:
            engine.train()
    if several_ranks():  # every rank's tokens
        both = torch.tensor([value for pair in sums.values() for value in pair], dtype=torch.float64, device=device)
        dist.all_reduce(both)
        sums = {name: both[2 * i:2 * i + 2].tolist() for i, name in enumerate(sums)}
    return {name: total / count for name, (total, count) in sums.items() if count}


def _reverse_kl(student: torch.nn.Module, teacher: Any, batch: Any, scored: Any) -> tuple[float, int]:
    kl = served_reverse_kl_sum if isinstance(teacher, ServedTeacher) else reverse_kl_sum
    return kl(student, teacher, batch, scored)


def _add(into: list, value: tuple[float, int]) -> None:
    into[0] += value[0]
    into[1] += value[1]
