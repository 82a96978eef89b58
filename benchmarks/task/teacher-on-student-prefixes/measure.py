"""One-off reproducer of result.json beside it (RESULTS.md, issue 49, part 4): how good is the teacher's signal on the
student's own prefixes?

On-policy distillation scores the teacher on the student's samples: at each position of a sampled response, the
teacher's distribution after the student's prefix. Where the student has already slipped (a wrong digit in an early
line of the worked solution), the teacher's best continuation of that prefix may no longer lead to the right answer,
and no loss over its distribution can teach the student the answer from there. This measures it on the built-in
task's held-out problems:

1. the student (a warm start) samples one response per problem at temperature 1 (what an on-policy step trains on);
2. each response is cut after a fraction of its tokens (``--cuts``: 0 is the prompt alone, the teacher's own
   accuracy; 1 the whole response, the student's); the teacher continues each cut greedily;
3. per cut: the teacher's accuracy over every prefix, over the prefixes still on the worked solution's path (their
   text a prefix of the reference's) and over those already off it; and where the samples leave the worked solution
   (their first token that differs from the reference's).

    python benchmarks/task/teacher-on-student-prefixes/measure.py --student WARM/model --teacher TEACHER/model \\
        --task arithmetic-5d --problems 200 --output benchmarks/task/teacher-on-student-prefixes/result.json

``WARM``: a warm start as the recipe makes it (``opsd-rollout train --task arithmetic-5d --task-labelled 300 --objective
sft --steps 600 --lr 3e-3 --prompts-per-micro-batch 16 --max-new-tokens 134 --output-dir WARM``); ``TEACHER``: the
task's teacher (``opsd-rollout train --task arithmetic-5d`` makes and caches it; any checkpoint directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.int64)
        mask[i, width - len(row):] = 1
    return ids, mask


def responses(rollout, tokenizer, rows: list[list[int]], sampling, batch: int, seed: int) -> list[list[int]]:
    """Each row's generated tokens, up to and without its first EOS."""
    from deepspeed.runtime.rollout import RolloutRequest

    out: list[list[int]] = []
    for start in range(0, len(rows), batch):
        ids, mask = left_padded(rows[start:start + batch], tokenizer.pad_token_id)
        got = rollout.generate(RolloutRequest(ids, mask), sampling, seed=seed + start)
        first = int(got.response_start_idx[0])
        for row, keep in zip(got.input_ids[:, first:], got.attention_mask[:, first:]):
            tokens = row[keep.bool()].tolist()
            out.append(tokens[:tokens.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in tokens else tokens)
    return out


def measurement_flags(parser: argparse.ArgumentParser, problems: int) -> None:
    """The flags of a measurement on a student's own samples (this one's, and ``gradient-by-position``'s)."""
    parser.add_argument("--student", required=True, help="the student's model directory (a warm start)")
    parser.add_argument("--teacher", required=True, help="the teacher's model directory")
    parser.add_argument("--task", default="arithmetic-5d", help="a built-in task (default arithmetic-5d)")
    parser.add_argument("--problems", type=int, default=problems, help=f"held-out problems, one sample each "
                        f"(default {problems})")
    parser.add_argument("--max-new-tokens", type=int, default=134, help="a response's tokens (the task's 134)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, required=True)


def measured_setting(args: argparse.Namespace) -> tuple[list, Any, Any, Any, list[list[int]]]:
    """What ``measurement_flags`` name, loaded (the seed set): the held-out problems, the student, the teacher, the
    tokenizer and each problem's prompt tokens."""
    from opsd_rollout.models import load_model
    from opsd_rollout.quiet import quiet
    from opsd_rollout.train.tasks import TASKS

    torch.manual_seed(args.seed)
    problems = TASKS[args.task].problems()[1][:args.problems]
    with quiet(False):
        student, tokenizer = load_model(args.student)
        teacher, _ = load_model(args.teacher)
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    return problems, student, teacher, tokenizer, prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    measurement_flags(parser, problems=200)
    parser.add_argument("--cuts", default="0,0.05,0.1,0.15,0.25,0.5,1", help="fractions of each response kept")
    parser.add_argument("--batch", type=int, default=50, help="rows a rollout")
    args = parser.parse_args(argv)
    cuts = [float(c) for c in args.cuts.split(",")]
    if any(not 0 <= c <= 1 for c in cuts):
        parser.error(f"--cuts: fractions from 0 to 1; got {args.cuts}")

    from deepspeed.runtime.rollout import SamplingConfig

    from opsd_rollout import HybridEngineRollout, HybridEngineRolloutConfig
    from opsd_rollout.files import write_json_atomic
    from opsd_rollout.train.scorers import extract
    from opsd_rollout.train.tasks import SCORERS

    start = time.perf_counter()
    problems, student, teacher, tokenizer, prompts = measured_setting(args)
    config = HybridEngineRolloutConfig(enable_profiling=False)
    sampled = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0)
    with torch.no_grad():
        own = responses(HybridEngineRollout(student.eval(), tokenizer, config), tokenizer, prompts, sampled,
                        args.batch, args.seed)
        teacher_rollout = HybridEngineRollout(teacher.eval(), tokenizer, config)
        rows = []
        for cut in cuts:
            kept = [response[:round(cut * len(response))] for response in own]
            # the teacher's continuation has the tokens the response had left (at least one)
            width = max(1, args.max_new_tokens - min(len(k) for k in kept))
            greedy = SamplingConfig(max_new_tokens=width, temperature=0.0)
            more = responses(teacher_rollout, tokenizer, [p + k for p, k in zip(prompts, kept)], greedy, args.batch,
                             args.seed)
            for problem, prefix, continuation in zip(problems, kept, more):
                prefix_text = tokenizer.decode(prefix, skip_special_tokens=True)
                answer = extract(SCORERS[args.task], prefix_text + tokenizer.decode(continuation,
                                                                                    skip_special_tokens=True))
                rows.append({"cut": cut, "on_path": problem.reference.startswith(prefix_text),
                             "correct": answer == str(problem.answer), "prefix_tokens": len(prefix)})
    references = [tokenizer(p.reference, add_special_tokens=False)["input_ids"] for p in problems]
    # where each sample leaves the worked solution: its first token that differs from the reference's
    leaves = sorted(next((i for i, (a, b) in enumerate(zip(r, ref)) if a != b), min(len(r), len(ref)))
                    for r, ref in zip(own, references))
    student_correct = [extract(SCORERS[args.task], tokenizer.decode(r, skip_special_tokens=True)) == str(p.answer)
                       for p, r in zip(problems, own)]
    summary = []
    for cut in cuts:
        at = [r for r in rows if r["cut"] == cut]
        on, off = [r for r in at if r["on_path"]], [r for r in at if not r["on_path"]]

        def share(group: list[dict]) -> float | None:
            return sum(r["correct"] for r in group) / len(group) if group else None

        summary.append({"cut": cut, "teacher_accuracy": share(at), "on_path": len(on),
                        "teacher_accuracy_on_path": share(on), "off_path": len(off),
                        "teacher_accuracy_off_path": share(off),
                        "mean_prefix_tokens": sum(r["prefix_tokens"] for r in at) / len(at)})
    document = {"command": " ".join(["measure.py", *(argv if argv is not None else sys.argv[1:])]),
                "task": args.task, "problems": len(problems), "student": args.student, "teacher": args.teacher,
                "student_sampled_accuracy": sum(student_correct) / len(problems), "cuts": summary,
                "leaves_the_solution_at_token": {"median": leaves[len(leaves) // 2], "p10": leaves[len(leaves) // 10],
                                                 "p90": leaves[9 * len(leaves) // 10],
                                                 "mean_response_tokens": sum(map(len, own)) / len(own)},
                "examples": [{"reference": p.reference, "student": tokenizer.decode(r, skip_special_tokens=True)}
                             for p, r in zip(problems[:3], own)],
                "seconds": time.perf_counter() - start}
    write_json_atomic(args.output, document)
    print(f"student's own samples (temperature 1): {document['student_sampled_accuracy']:.1%} correct; they leave "
          f"the worked solution at token {leaves[len(leaves) // 2]} (median; 10th-90th percentile "
          f"{leaves[len(leaves) // 10]}-{leaves[9 * len(leaves) // 10]}) of {sum(map(len, own)) / len(own):.0f}")
    for s in summary:
        on = "-" if s["teacher_accuracy_on_path"] is None else f"{s['teacher_accuracy_on_path']:.1%}"
        off = "-" if s["teacher_accuracy_off_path"] is None else f"{s['teacher_accuracy_off_path']:.1%}"
        print(f"cut {s['cut']:.2f} (~{s['mean_prefix_tokens']:.0f} tokens): teacher {s['teacher_accuracy']:.1%}; "
              f"on the path {s['on_path']} ({on}), off it {s['off_path']} ({off})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
