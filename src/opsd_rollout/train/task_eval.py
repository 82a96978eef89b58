"""Task evaluation: what a model gets right on problems with known answers, read by a scorer (``scorers.py``).

Greedy accuracy, and with ``samples`` K > 1, pass@1 averaged over K samples per problem (the mean of c/K) and the
unbiased pass@K (Chen et al. 2021), as NeMo-RL and Thinking Machines report a distilled student against its
teacher. Completions come from our rollout engine (``HybridEngineRollout``), batched: greedy, then K sampled per
prompt from a fixed seed (the same samples at every evaluation; the caller's random state untouched). An answer the
scorer cannot read counts wrong and is counted apart. ``TaskEvalResult`` is what training records and what
``opsd-rollout eval`` prints and writes; ``TaskEvalConfig`` (what is scored) is in the light ``eval_file.py``.

On several ranks every rank scores its share of the problems in as many rollouts as the others (the ones it lacks
run over its first prompts, their result unused), so that ZeRO-3's gathers and the rollouts' own collectives meet;
the problems' scores are then gathered on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from opsd_rollout.distributed import agree_max, gather_objects, rank_info
from opsd_rollout.modeling import max_positions_of, text_config
from opsd_rollout.seeding import seeded
from opsd_rollout.train.data import Encoder, Example, render_messages
from opsd_rollout.train.eval_file import EvalRecord, TaskEvalConfig
from opsd_rollout.train.scorers import extract, pass_at_k


@dataclass(frozen=True)
class ProblemScore:
    """One problem's outcome."""

    line: int
    """The problem's line in the eval file."""
    answer: str
    """The reference's answer, as the scorer reads it."""
    greedy: str | None
    """The greedy completion's answer; ``None``: none the scorer can read."""
    completion: str
    """The greedy completion's text."""
    correct: int | None = None
    """Of the K samples (K > 1), how many reached the answer."""
    unextractable: int | None = None
    """Of the K samples (K > 1), how many gave no answer."""

    @property
    def greedy_correct(self) -> bool:
        return self.greedy is not None and self.greedy == self.answer


@dataclass(frozen=True)
class TaskEvalResult:
    """A model's scores on an eval file: every figure derives from the problems' own outcomes."""

    scorer: str
    samples: int
    problems: tuple[ProblemScore, ...]
    generated_tokens: int
    """Real completion tokens (greedy and sampled, EOS included, padding not)."""
    seconds: float
    """Wall time of the evaluation (rollouts, decoding, scoring)."""

    @property
    def accuracy(self) -> float:
        return sum(p.greedy_correct for p in self.problems) / len(self.problems)

    @property
    def unextractable(self) -> int:
        """Greedy completions with no answer the scorer can read (counted wrong)."""
        return sum(p.greedy is None for p in self.problems)

    @property
    def pass_at_1(self) -> float | None:
        """The mean over problems of c/K (K > 1), the probability one sample is right."""
        if self.samples == 1:
            return None
        return float(np.mean([p.correct / self.samples for p in self.problems]))

    @property
    def pass_at_k(self) -> float | None:
        """The mean over problems of the unbiased pass@K (K > 1): one of K samples is right."""
        if self.samples == 1:
            return None
        return float(np.mean([pass_at_k(self.samples, p.correct, self.samples) for p in self.problems]))

    @property
    def sampled_unextractable(self) -> int | None:
        return None if self.samples == 1 else sum(p.unextractable for p in self.problems)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def record(self, prefix: str = "eval_") -> dict[str, float]:
        """The training record's keys (``metrics.TRAINING``): ``eval_accuracy``, ``eval_unextractable``, and with
        K > 1 ``eval_pass@1`` and ``eval_pass@K`` (K the number); ``prefix`` ``teacher_eval_`` for the teacher's."""
        figures = {f"{prefix}accuracy": self.accuracy, f"{prefix}unextractable": self.unextractable}
        if self.samples > 1:
            figures.update({f"{prefix}pass@1": self.pass_at_1, f"{prefix}pass@{self.samples}": self.pass_at_k})
        return figures

    def to_dict(self) -> dict[str, Any]:
        """For JSON: the figures (``pass@1``, ``pass@K`` and ``sampled_unextractable`` with K > 1), then every
        problem's outcome."""
        sampled = {"pass@1": self.pass_at_1, f"pass@{self.samples}": self.pass_at_k,
                   "sampled_unextractable": self.sampled_unextractable} if self.samples > 1 else {}
        return {"scorer": self.scorer, "samples": self.samples, "problems": len(self.problems),
                "accuracy": self.accuracy, "correct": sum(p.greedy_correct for p in self.problems),
                "unextractable": self.unextractable, **sampled, "generated_tokens": self.generated_tokens,
                "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "per_problem": [{**asdict(p), "greedy_correct": p.greedy_correct} for p in self.problems]}


@dataclass(frozen=True)
class Problem:
    """An eval record ready for the rollout: its prompt rendered (the chat template for ``messages``)."""

    record: EvalRecord
    example: Example


def render_problems(records: list[EvalRecord], tokenizer: Any, *, max_prompt_tokens: int) -> list[Problem]:
    """The records' prompts as the model reads them, each checked to fit ``max_prompt_tokens`` (the model's
    positions less the completion's tokens): an eval prompt is never cut."""
    problems = []
    for record in records:
        example = (render_messages(record.messages, tokenizer) if record.messages is not None
                   else Example(record.prompt))
        length = len(tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
        if length > max_prompt_tokens:
            raise ValueError(f"--eval-data line {record.line}: the prompt has {length} tokens, over the "
                             f"{max_prompt_tokens} the model's positions leave beside the completion's: lower "
                             "--eval-max-new-tokens or shorten the prompt")
        problems.append(Problem(record, Example(example.prompt)))
    return problems


def task_problems(records: list[EvalRecord], tokenizer: Any, models: list[Any], max_new_tokens: int) -> list[Problem]:
    """``render_problems`` for ``models`` (the modules among them: a served teacher is not scored): every prompt
    fits the fewest positions less ``max_new_tokens``."""
    limits = [max_positions_of(text_config(m.config)) for m in models if isinstance(m, torch.nn.Module)]
    positions = min((p for p in limits if p), default=1 << 30)
    if max_new_tokens >= positions:
        raise ValueError(f"--eval-max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                         f"{positions} positions")
    return render_problems(records, tokenizer, max_prompt_tokens=positions - max_new_tokens)


def _completions(batch: Any, tokenizer: Any) -> tuple[list[str], int]:
    """Each row's response as text (up to its first EOS, special tokens dropped), and the real tokens generated."""
    start = int(batch.response_start_idx[0])
    ids, mask = batch.input_ids[:, start:].cpu(), batch.attention_mask[:, start:].cpu()
    texts = [tokenizer.decode(row[keep.bool()].tolist(), skip_special_tokens=True) for row, keep in zip(ids, mask)]
    return texts, int(mask.sum())


@torch.no_grad()
def evaluate_task(model: Any, rollout: Any, tokenizer: Any, problems: list[Problem], config: TaskEvalConfig,
                  sampling: Any, *, max_new_tokens: int, seed: int, batch_size: int,
                  progress: Callable[[int], None] | None = None) -> TaskEvalResult:
    """Score ``model`` (a DeepSpeed engine or a module; ``rollout`` generates with it) on ``problems``: greedy
    completions, and with ``config.samples`` K > 1 K samples per problem drawn with ``sampling``'s temperature,
    top-k and top-p from ``seed``; ``batch_size`` prompts per rollout. ``progress(n)`` is told of each ``n``
    problems done (this rank's)."""
    module = getattr(model, "module", model)
    device = torch.device(getattr(model, "device", next(module.parameters()).device))
    rank = rank_info()
    shard = problems[rank.rank::rank.world_size] or problems[:1]  # a rank without a problem only keeps step
    mine = problems[rank.rank::rank.world_size]
    encoder = Encoder(tokenizer, max_prompt_tokens=1 << 30, max_reference_tokens=max_new_tokens)
    greedy = replace(sampling, max_new_tokens=max_new_tokens, n_samples_per_prompt=1, temperature=0.0)
    sampled = replace(sampling, max_new_tokens=max_new_tokens, n_samples_per_prompt=config.samples)
    chunks = [shard[i:i + batch_size] for i in range(0, len(shard), batch_size)]
    # every rank as many rollouts as the rank with the most (ZeRO-3's gathers, the width); one rank, its own
    (count,) = agree_max([len(chunks)], device)
    chunks += [shard[:batch_size]] * (count - len(chunks))
    was_training = module.training
    model.eval()
    scores, tokens, start = [], 0, time.perf_counter()
    try:
        with seeded(seed, device):
            for index, chunk in enumerate(chunks):
                request = encoder.request([p.example for p in chunk], device)
                texts, used = _completions(rollout.generate(request, greedy), tokenizer)
                samples: list[str] = []
                if config.samples > 1:
                    samples, more = _completions(rollout.generate(request, sampled, seed=seed + index), tokenizer)
                    used += more
                if index * batch_size >= len(mine):
                    continue  # a rollout run to keep step with the other ranks
                tokens += used
                for row, problem in enumerate(chunk):
                    own = samples[row * config.samples:(row + 1) * config.samples]
                    scores.append(_score(problem, texts[row], own, config))
                if progress is not None:
                    progress(len(chunk))
    finally:
        if was_training:
            model.train()
    seconds = time.perf_counter() - start
    scores, tokens, seconds = _gathered(scores, tokens, seconds)
    return TaskEvalResult(config.scorer, config.samples, tuple(sorted(scores, key=lambda s: s.line)), tokens, seconds)


def _score(problem: Problem, completion: str, samples: list[str], config: TaskEvalConfig) -> ProblemScore:
    answer = problem.record.answer
    score = ProblemScore(problem.record.line, answer, extract(config.scorer, completion), completion)
    if config.samples == 1:
        return score
    found = [extract(config.scorer, text) for text in samples]
    return replace(score, correct=sum(a == answer for a in found), unextractable=sum(a is None for a in found))


def _gathered(scores: list[ProblemScore], tokens: int, seconds: float) -> tuple[list[ProblemScore], int, float]:
    """Every rank's problems, tokens summed, the slowest rank's time (as given with one rank)."""
    every = gather_objects((scores, tokens, seconds))
    return [s for part in every for s in part[0]], sum(p[1] for p in every), max(p[2] for p in every)
