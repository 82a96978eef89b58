"""One-off reproducer of the results beside it (RESULTS.md, issue 49, part 4): where in a sample does an on-policy
loss put its weight, and where do the student's samples leave the teacher's support?

An on-policy step averages a per-token divergence over every token of the student's own samples. On the built-in
task a response first copies the problem's operands (``85685+43562``), then works the sum line by line; a student that
copies wrongly is taught the teacher's arithmetic on numbers the problem does not have (``teacher-on-student-prefixes``
beside this). This measures, on the student's samples for held-out problems (one a problem, at ``--temperature``:
1 by default, as a step samples; 0 is greedy, the student's own first choices), per part of each response: the copy
(the tokens of the reference's operands, before its first ``:``), the rest of the first line, and the lines after:

- its tokens' share, and where the sampled tokens sit in the teacher's distribution (the teacher's probability of
  the student's token: the share under 1%, the median; the share where it is not the teacher's first choice);
- for each loss (``--losses``: ``reverse_kl``, ``jsd`` at beta 0.5, ``forward_kl``, over the teacher's full
  distribution): the part's share of the step's loss (the token mean, as the step takes it), the norm of the part's
  own gradient against the whole step's, and their cosine. Each part's gradient is the gradient of its tokens' terms
  of the token mean, so the three sum to the step's gradient.

    python benchmarks/task/gradient-by-position/measure.py --student WARM/model --teacher TEACHER/model \\
        --task arithmetic-5d --problems 64 --output benchmarks/task/gradient-by-position/result-5d.json

``WARM`` and ``TEACHER`` as in ``benchmarks/task/teacher-on-student-prefixes/measure.py`` (a warm start of the recipe
and the task's teacher); any student checkpoint can stand for ``WARM`` (e.g. an arm's model after its steps).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PARTS = ("copy", "first line", "later lines")


def _prefix_script():
    """The sibling measurement, for its rollout helpers (``responses``, ``left_padded``)."""
    spec = importlib.util.spec_from_file_location("prefixes", HERE.parent / "teacher-on-student-prefixes" / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def part_of_each_token(tokenizer, reference: str, response: list[int]) -> list[int]:
    """0 (the copy: as many tokens as the reference's operands take), 1 (the rest of the response's first line), 2
    (after it), per response token."""
    copy = len(tokenizer(reference.split(":")[0], add_special_tokens=False)["input_ids"])
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    parts, line = [], 0
    for index, token in enumerate(response):
        parts.append(0 if index < copy else (1 if line == 0 else 2))
        if newline and token == newline[-1]:
            line += 1
    return parts


def main(argv: list[str] | None = None) -> int:
    prefixes = _prefix_script()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    prefixes.measurement_flags(parser, problems=64)
    parser.add_argument("--losses", default="reverse_kl,jsd,forward_kl", help="comma list of the losses measured")
    parser.add_argument("--temperature", type=float, default=1.0, help="the student's sampling temperature (default "
                        "1, as an on-policy step samples; 0: greedy)")
    args = parser.parse_args(argv)
    if not args.temperature >= 0:
        parser.error(f"--temperature: expected 0 (greedy) or above; got {args.temperature}")
    losses = [name for name in args.losses.split(",") if name]
    if not losses or any(name not in ("reverse_kl", "jsd", "forward_kl") for name in losses):
        parser.error(f"--losses: a comma list of reverse_kl, jsd, forward_kl; got {args.losses!r}")

    from deepspeed.runtime.rollout import SamplingConfig

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig
    from opsd_rollout.files import write_json_atomic
    from opsd_rollout.opsd.divergence import DivergenceConfig, token_divergence

    start = time.perf_counter()
    problems, student, teacher, tokenizer, prompts = prefixes.measured_setting(args)
    with torch.no_grad():
        own = prefixes.responses(HybridEngineRollout(student.eval(), tokenizer,
                                                     HybridEngineRolloutConfig(enable_profiling=False)),
                                 tokenizer, prompts, SamplingConfig(max_new_tokens=args.max_new_tokens,
                                                                    temperature=args.temperature), len(prompts),
                                 args.seed)
    rows = [p + r for p, r in zip(prompts, own)]
    ids, mask = prefixes.left_padded(rows, tokenizer.pad_token_id)
    width = ids.shape[1]
    part = torch.full(ids.shape, -1, dtype=torch.int64)  # each position's part (predicting the token there), -1 none
    for i, (prompt, response, problem) in enumerate(zip(prompts, own, problems)):
        first = width - len(response)
        part[i, first:] = torch.tensor(part_of_each_token(tokenizer, problem.reference, response), dtype=torch.int64)
    part = part[:, 1:]  # logits at position t predict token t + 1
    targets = ids[:, 1:]
    tokens = int((part >= 0).sum())
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1].float()
    teacher_logp = torch.log_softmax(teacher_logits, dim=-1)
    sampled_p = teacher_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).exp()
    first_choice = teacher_logp.argmax(-1) == targets

    support = {}
    for index, name in enumerate(PARTS):
        at = part == index
        count = int(at.sum())
        probabilities = sampled_p[at]
        support[name] = {"tokens": count, "share_of_tokens": count / tokens,
                         "teacher_probability_under_1pct": float((probabilities < 0.01).float().mean()) if count else None,
                         "teacher_probability_median": float(probabilities.median()) if count else None,
                         "not_the_teachers_first_choice": float((~first_choice[at]).float().mean()) if count else None}

    student.train()
    parameters = [p for p in student.parameters() if p.requires_grad]
    logits = student(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1].float()
    by_loss = {}
    for loss in losses:
        config = DivergenceConfig(loss=loss, beta=0.5)
        per_token = token_divergence(logits, teacher_logits, config)
        gradients, shares = [], []
        for index in range(len(PARTS)):
            term = (per_token * (part == index)).sum() / tokens  # this part's terms of the step's token mean
            shares.append(float(term.detach()))
            grads = torch.autograd.grad(term, parameters, retain_graph=True, allow_unused=True)
            gradients.append(torch.cat([(g if g is not None else torch.zeros_like(p)).flatten()
                                        for g, p in zip(grads, parameters)]))
        whole = torch.stack(gradients).sum(0)
        total = sum(shares)
        by_loss[loss] = {"loss": total, "parts": {
            name: {"share_of_loss": shares[i] / total if total else None,
                   "loss_per_token": shares[i] * tokens / support[name]["tokens"] if support[name]["tokens"] else None,
                   "gradient_norm_over_the_steps": float(gradients[i].norm() / whole.norm()),
                   "cosine_with_the_steps": float(torch.nn.functional.cosine_similarity(gradients[i], whole, dim=0))}
            for i, name in enumerate(PARTS)}}

    document = {"command": " ".join(["measure.py", *(argv if argv is not None else sys.argv[1:])]),
                "task": args.task, "problems": len(problems), "student": args.student, "teacher": args.teacher,
                "temperature": args.temperature,
                "response_tokens": tokens, "mean_response_tokens": tokens / len(own), "support": support,
                "losses": by_loss, "seconds": time.perf_counter() - start}
    write_json_atomic(args.output, document)
    print(f"{len(own)} samples, {tokens / len(own):.0f} tokens each on average")
    for name, s in support.items():
        print(f"{name}: {s['share_of_tokens']:.1%} of the tokens; the teacher gives the student's token under 1% on "
              f"{s['teacher_probability_under_1pct']:.1%} of them (median {s['teacher_probability_median']:.3f}); "
              f"not its first choice on {s['not_the_teachers_first_choice']:.1%}")
    for loss, measured in by_loss.items():
        cells = "; ".join(f"{name}: {p['share_of_loss']:.1%} of the loss, gradient {p['gradient_norm_over_the_steps']:.2f}"
                          f" of the step's (cosine {p['cosine_with_the_steps']:.2f})"
                          for name, p in measured["parts"].items())
        print(f"{loss} ({measured['loss']:.3f} a token): {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
