"""The teacher's engine behind the server: one thread that takes queued requests, batches them up to a token
budget, runs the teacher once per batch and hands each request its rows' log-probabilities.

The HTTP side (``app.py``) only validates and queues; everything the model does happens on this thread, in the
order requests arrived (a batch is the queue's head, as many requests as fit ``max_batch_tokens``). Limits are
checked when a request is queued, so a request over one is refused at once with the limit's name, never run:
``max_model_len`` (tokens a row), ``max_logprobs`` (k), ``max_batch_tokens`` (a request's rows x its longest row:
it must fit one batch), and ``max_queue`` (requests waiting).
"""

from __future__ import annotations

import inspect
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from opsd_rollout import checks
from opsd_rollout.modeling import position_ids


@dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """What one server takes; a request past any is refused with the limit's name."""

    max_batch_tokens: int = 8192
    """Token positions (rows x longest row, padded) in one teacher forward; a request must fit one."""
    max_queue: int = 64
    """Requests waiting for the teacher; one more is refused (HTTP 429) until the queue drains."""
    max_logprobs: int = 64
    """The largest ``prompt_logprobs`` k (vLLM's ``--max-logprobs``)."""
    max_model_len: int = 2048
    """Tokens in one row (the teacher's positions)."""

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_queue", "max_model_len"):
            checks.integer(name, getattr(self, name))
        checks.integer("max_logprobs", self.max_logprobs, minimum=0)


class LimitExceeded(ValueError):
    """A request over a limit: ``limit`` names it, ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, limit: str, status: int = 400):
        super().__init__(message)
        self.limit, self.status = limit, status


@dataclass
class RowScores:
    """One row's answer at its n positions ``start``..L-1: at each position t the log-probability of token t (given
    tokens 0..t-1) and the top k (ids, values), and the given token's rank when asked."""

    start: int
    token_logprobs: torch.Tensor
    """[n] float32."""
    top_ids: torch.Tensor
    """[n, k] int64, most likely first."""
    top_logprobs: torch.Tensor
    """[n, k] float32."""
    ranks: torch.Tensor | None
    """[n] int64 (1: the most likely), or ``None`` when not asked (the compact answer sends none)."""


@dataclass
class Job:
    rows: list[list[int]]
    k: int
    starts: list[int]
    """Per row, the first position answered (>= 1)."""
    ranks: bool
    future: Future = field(default_factory=Future)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * max(len(row) for row in self.rows)


class TeacherEngine:
    """``submit(rows, k)`` -> a ``Future`` of one ``RowScores`` per row, computed on the engine's thread."""

    def __init__(self, model: torch.nn.Module, limits: EngineLimits, *, vocab_size: int):
        self.model, self.limits, self.vocab_size = model.eval(), limits, vocab_size
        self.device = next(model.parameters()).device
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        """Whether the model computes the LM head over the positions asked only (transformers' ``logits_to_keep``)."""
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=limits.max_queue)
        self.batches = 0
        """Teacher forwards run so far (a batch may hold several requests)."""
        self.thread = threading.Thread(target=self._run, name="teacher-engine", daemon=True)
        self.thread.start()

    def check(self, rows: list[list[int]], k: int) -> None:
        """Refuse, naming the limit, a request the engine will not run."""
        limits = self.limits
        if k > limits.max_logprobs:
            raise LimitExceeded(f"prompt_logprobs {k} is over max_logprobs {limits.max_logprobs} (serve-teacher "
                                "--max-logprobs)", "max_logprobs")
        for index, row in enumerate(rows):
            if len(row) > limits.max_model_len:
                raise LimitExceeded(f"prompt {index} has {len(row)} tokens, over max_model_len "
                                    f"{limits.max_model_len}", "max_model_len")
            bad = [token for token in row if token >= self.vocab_size]
            if bad:
                raise LimitExceeded(f"prompt {index} has token id {bad[0]}, outside the vocabulary "
                                    f"[0, {self.vocab_size})", "vocab_size")
        padded = len(rows) * max(len(row) for row in rows)
        if padded > limits.max_batch_tokens:
            raise LimitExceeded(f"the request's {len(rows)} prompts x {max(len(r) for r in rows)} tokens = {padded} "
                                f"token positions, over max_batch_tokens {limits.max_batch_tokens} (send fewer rows "
                                "a request, or serve with a larger --max-batch-tokens)", "max_batch_tokens", 413)

    def submit(self, rows: list[list[int]], k: int, starts: list[int] | None = None, ranks: bool = True) -> Future:
        """Queue ``rows``' scoring: from position ``starts[i]`` of row i (``None``: every position from 1) with the
        top ``k``, and the given tokens' ranks if ``ranks``."""
        self.check(rows, k)
        job = Job(rows, k, [1] * len(rows) if starts is None else starts, ranks)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise LimitExceeded(f"the teacher's queue is full ({self.limits.max_queue} requests waiting, max_queue): "
                                "retry later", "max_queue", 429) from None
        return job.future

    def close(self) -> None:
        """Stop the thread after the queued jobs (it waits for room in a full queue)."""
        self.jobs.put(None)
        self.thread.join()

    def _run(self) -> None:
        carry: Job | None = None
        while True:
            first = carry or self.jobs.get()
            carry = None
            if first is None:
                return
            batch, stop = [first], False
            while True:  # the queue's head: as many requests as fit the token budget
                try:
                    nxt = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                if self._padded(batch + [nxt]) > self.limits.max_batch_tokens:
                    carry = nxt
                    break
                batch.append(nxt)
            try:
                answers = self.score([row for job in batch for row in job.rows], max(job.k for job in batch),
                                     [start for job in batch for start in job.starts], any(j.ranks for j in batch))
            except Exception as error:  # noqa: BLE001 - every waiting request hears why
                for job in batch:
                    job.future.set_exception(error)
                continue
            for job in batch:
                job.future.set_result([_top(answer, job.k) for answer in answers[:len(job.rows)]])
                answers = answers[len(job.rows):]
            if stop:
                return

    @staticmethod
    def _padded(jobs: list[Job]) -> int:
        return sum(len(job.rows) for job in jobs) * max(len(row) for job in jobs for row in job.rows)

    @torch.no_grad()
    def score(self, rows: list[list[int]], k: int, starts: list[int] | None = None,
              ranks: bool = True) -> list[RowScores]:
        """One forward over ``rows`` (right-padded; positions from each row's first token, as the in-process
        teacher numbers them), the LM head over the positions asked only where the model allows, then per row the
        log-probabilities from ``starts[i]`` on (``None``: from 1) in float32."""
        self.batches += 1
        starts = [1] * len(rows) if starts is None else starts
        width = max(len(row) for row in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            ids[index, :len(row)] = torch.tensor(row)
            mask[index, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # logits at column c predict token c + 1: the columns from the earliest start - 1 to the last but one
        first = max(0, min(min(starts) - 1, width - 2)) if self.keeps_logits else 0
        keep = {"logits_to_keep": torch.arange(first, width - 1, device=self.device)} if first > 0 else {}
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), **keep).logits
        answers = []
        for index, (row, start) in enumerate(zip(rows, starts)):
            logp = F.log_softmax(logits[index, start - 1 - first:len(row) - 1 - first].float(), dim=-1)  # [n, V]
            given = ids[index, start:len(row)].unsqueeze(-1)
            token = logp.gather(-1, given)  # [n, 1]
            top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            answers.append(RowScores(start, token.squeeze(-1), top.indices, top.values,
                                     (logp > token).sum(-1) + 1 if ranks else None))
        return answers


def _top(answer: RowScores, k: int) -> RowScores:
    """A batch computes the largest k any of its requests asked for; each request gets its own k."""
    if answer.top_ids.shape[-1] == k:
        return answer
    return RowScores(answer.start, answer.token_logprobs, answer.top_ids[:, :k], answer.top_logprobs[:, :k],
                     answer.ranks)
