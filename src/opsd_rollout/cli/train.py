"""``opsd-rollout train``: its flags, each mapped onto a ``TrainConfig`` field by its name (the sections' fields
through ``opsd_rollout.train.config.FLAT``). A light module (argparse and the standard library), so ``--help``
answers without importing torch."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from opsd_rollout.cli.common import LOCAL_RANK_FLAGS
from opsd_rollout.deepspeed_config import LEARNING_RATE
from opsd_rollout.placement import DTYPES, device_flag
from opsd_rollout.train.teacher_spec import DEFAULTS, KEY_VARIABLE
from opsd_rollout.train.tasks import TASKS

TASK_NAMES = tuple(TASKS)
LOSSES = ("forward_kl", "reverse_kl", "jsd", "sampled_reverse_kl")
FLAGS: list[tuple[str, str, dict[str, Any]]] = [  # (flag, TrainConfig's flat name, argparse keywords)
    ("--student", "student", dict(help="preset or local checkpoint directory (default llama-tiny; with no model or "
                                       "data flag at all: the built-in run, see the description)")),
    ("--teacher", "teacher", dict(action="append", metavar="[NAME=]PRESET_OR_DIR", help="preset or local checkpoint "
                                  "of the student's vocabulary (needed to distil), or self: the student is its own "
                                  "teacher, shown the reference (on-policy self-distillation); repeat it as "
                                  "NAME=PRESET_OR_DIR for several teachers, each example going to the one its "
                                  "'teacher' field names (the one given without a name, or the first named, takes "
                                  "the rest)")),
    ("--self-teacher", "self_teacher", dict(choices=("initial", "live"), help="with --teacher self, which weights "
                                            "teach: initial (default), the student's starting weights, frozen (a "
                                            "LoRA student's base with its adapters off: no second copy); live, the "
                                            "student as it trains, without gradient")),
    ("--teacher-context", "teacher_context", dict(metavar="TEMPLATE", help="the teacher's own prompt: a text with "
                                                  "{prompt} and {reference}, filled per example (a chat example's "
                                                  "last user turn), so the teacher scores the student's response "
                                                  "knowing the answer (default with --teacher self: the problem, the "
                                                  "reference solution, then an instruction to solve it in its own "
                                                  "words; else the student's prompt)")),
    ("--prompts", "prompts", dict(metavar="FILE", help="JSON lines with 'prompt' (or chat 'messages': a new "
                                  "assistant turn after a last user or tool turn, a last assistant turn continued) "
                                  "and an optional 'reference', or one prompt a line (default: the built-in corpus, "
                                  "the Python documentation's topics)")),
    ("--task", "task", dict(choices=TASK_NAMES, help="a built-in task's examples instead of --prompts: "
                            "arithmetic (addition word problems made from a seed, worked solutions ending in "
                            "'#### N'); with no --student, --teacher or --teacher-url: its built-in run, a teacher "
                            "trained on it by SFT (cached) distilled into a smaller student")),
    ("--task-labelled", "task_labelled", dict(type=int, metavar="N", help="with --task: the first N training problems "
                                              "keep their worked solution (the labelled set a warm start and SFT "
                                              "train on), the rest are prompts alone (default: every one labelled)")),
    ("--task-unlabelled", "task_unlabelled", dict(type=int, metavar="N", help="with --task-labelled: how many prompts "
                                                  "without a solution follow the labelled set (default: the rest)")),
    ("--warmup-sft-steps", "warmup_sft_steps", dict(type=int, metavar="N", help="a warm start: the first N optimizer "
                                                    "steps (of --steps) are SFT on the examples with a reference, "
                                                    "then the run distils (default 0)")),
    ("--warmup-sft-lr", "warmup_sft_lr", dict(type=float, metavar="LR", help="the warm start's learning rate (default: "
                                              "--lr)")),
    ("--objective", "objective", dict(choices=("opsd", "sft"), help="opsd (default): distil the teacher on-policy; "
                                      "sft: cross-entropy on the references")),
    ("--deepspeed", "deepspeed", dict(metavar="JSON", help="the student's DeepSpeed config (ZeRO stage, optimizer, "
                                      "scheduler, gradient_accumulation_steps, bf16, tensorboard/wandb/csv_monitor); "
                                      "default: one built from the flags below")),
    ("--dtype", "dtype", dict(choices=DTYPES, help="the run's precision, the student's and every teacher's "
                              "(default auto: the --deepspeed config's bf16/fp16 section when it turns one on, else "
                              "bf16 on a GPU and fp32 on the CPU; a config that says otherwise is refused)")),
    ("--device", "device", dict(type=device_flag, metavar="{auto,cpu,cuda,cuda:N}", help="where the student and "
                                "its teachers run (default auto: DeepSpeed's accelerator, a GPU when there is one, "
                                "each rank its own)")),
    ("--zero-stage", "zero_stage", dict(type=int, choices=(0, 1, 2, 3), help="ZeRO stage of the built config "
                                        "(default 0)")),
    ("--lr", "lr", dict(type=float, help=f"AdamW learning rate of the built config (default {LEARNING_RATE:g})")),
    ("--gradient-accumulation-steps", "gradient_accumulation_steps", dict(
        type=int, metavar="N", help="micro-batches per optimizer step, each with its own rollout, in the built "
        "config (default 1)")),
    ("--steps", "steps", dict(type=int, metavar="N", help="optimizer steps (default 100)")),
    ("--prompts-per-micro-batch", "prompts_per_micro_batch", dict(
        type=int, metavar="N", help="prompts per micro-batch, each rank's; DeepSpeed's micro-batch is this x "
        "--samples-per-prompt rows (default 8)")),
    ("--samples-per-prompt", "samples_per_prompt", dict(type=int, metavar="N", help="samples per prompt (default 1)")),
    ("--max-new-tokens", "max_new_tokens", dict(type=int, metavar="N", help="response tokens (default 32)")),
    ("--max-prompt-tokens", "max_prompt_tokens", dict(type=int, metavar="N", help="longest prompt accepted "
                                                      "(default: the models' positions less --max-new-tokens)")),
    ("--temperature", "temperature", dict(type=float, help="sampling temperature (default 1.0)")),
    ("--top-k", "top_k", dict(type=int, help="sampling top-k, <= 0 disables (default 0)")),
    ("--top-p", "top_p", dict(type=float, help="sampling top-p (default 1.0)")),
    ("--lmbda", "lmbda", dict(type=float, help="fraction of steps on the student's own samples, as TRL's GKD "
                              "defines it; the rest on the teacher's samples, or the references when the data has "
                              "them (default 1.0)")),
    ("--off-policy", "off_policy", dict(choices=("auto", "references", "teacher"), help="what the steps that are not "
                                        "on-policy train on: the references, the teacher's samples (supervised KD), "
                                        "or auto (default): the references when every example has one")),
    ("--loss", "loss", dict(choices=LOSSES, help="divergence (default jsd); sampled_reverse_kl: the teacher's "
                            "log-probability of each sampled token only, as a policy gradient (on-policy). Judged by "
                            "task accuracy from random weights, jsd and sampled_reverse_kl stayed at 0%% where "
                            "forward_kl learnt: warm-start them (--warmup-sft-steps)")),
    ("--estimator", "estimator", dict(choices=("k1", "k3"), help="sampled_reverse_kl's per-token estimate: k1 "
                                      "(default) or k3 (verl's low-variance estimator)")),
    ("--beta", "beta", dict(type=float, help="generalized JSD interpolation (default 0.5)")),
    ("--teacher-cache", "teacher_cache", dict(choices=("full", "topk", "sampled"), help="teacher logits cached "
                                              "whole, their top-k, or each sampled token's log-probability "
                                              "(default: sampled for sampled_reverse_kl, else full)")),
    ("--teacher-url", "teacher_url", dict(action="append", metavar="[NAME=]URL", help="a served teacher: vLLM's or "
                                          "SGLang's server, or opsd-rollout serve-teacher (an unnamed --teacher then "
                                          "names the model it must serve); its cache is topk (default) or sampled, "
                                          "never full; repeat it as NAME=URL for several")),
    ("--default-teacher", "default_teacher", dict(metavar="NAME", help="with several teachers, the one of examples "
                                                  "without a 'teacher' field (default: the one given without a "
                                                  "name, else the first named)")),
    ("--teacher-api-key", "teacher_api_key", dict(metavar="KEY", help="the served teacher's --api-key; better "
                                                  "in $OPSD_ROLLOUT_API_KEY (the default), as a command line is "
                                                  "visible to every user of the machine; never printed, logged or "
                                                  "written to train_config.json")),
    ("--teacher-timeout", "teacher_timeout", dict(type=float, metavar="SECONDS", help="how long an unanswering "
                                                  "teacher server is retried, at the start and mid-run, before the "
                                                  "run stops with a checkpoint (default 120)")),
    ("--teacher-protocol", "teacher_protocol", dict(choices=("vllm", "sglang"), help="the served teacher's API: "
                                                    "vllm (default; also serve-teacher's) or sglang")),
    ("--top-k-rest", "top_k_rest", dict(choices=("renormalize", "tail"), help="a top-k teacher cache's rest of the "
                                        "vocabulary: renormalize both distributions over the k tokens, or keep "
                                        "each side's rest as one tail bucket (default: tail with --teacher-url, "
                                        "else renormalize)")),
    ("--teacher-overlap", "teacher_overlap", dict(action=argparse.BooleanOptionalAction, help="a served teacher's "
                                                  "requests in flight behind the student's forward and, with "
                                                  "gradient accumulation, the next micro-batches' rollouts; "
                                                  "--no-teacher-overlap waits for each (the same samples and "
                                                  "losses). Default: on, but off for a server on loopback with the "
                                                  "student on the CPU (the same cores)")),
    ("--teacher-zero-stage", "teacher_zero_stage", dict(type=int, choices=(0, 3), help="0 (default): the teacher "
                                                        "whole on every rank; 3: a DeepSpeed ZeRO-3 inference engine, "
                                                        "its parameters partitioned across the ranks")),
    ("--teacher-top-k", "teacher_top_k", dict(type=int, metavar="K", help="k of --teacher-cache topk (default 64)")),
    ("--seed", "seed", dict(type=int, help="makes a run repeatable (default 0)")),
    ("--eval-every", "eval_every", dict(type=int, metavar="N", help="held-out evaluation every N steps, and at step "
                                        "0 and the last (default 10)")),
    ("--eval-prompts", "eval_prompts", dict(type=int, metavar="N", help="held-out prompts evaluated (default 64)")),
    ("--eval-data", "eval_data", dict(metavar="FILE", help="task evaluation at every evaluation: JSON lines with "
                                      "'prompt' (or chat 'messages') and 'answer'; the teacher is scored once at step "
                                      "0 (not a served teacher)")),
    ("--eval-scorer", "eval_scorer", dict(metavar="NAME", help="how --eval-data's answers are read: gsm8k (the "
                                          "number after ####), boxed (the last \\boxed{}), last-number or exact "
                                          "(the first line)")),
    ("--eval-samples", "eval_samples", dict(type=int, metavar="K", help="samples per problem at the run's "
                                            "--temperature: pass@1 averaged over K and the unbiased pass@K besides "
                                            "greedy accuracy (default 1: greedy alone)")),
    ("--eval-max-new-tokens", "eval_max_new_tokens", dict(type=int, metavar="N", help="tokens a task evaluation's "
                                                          "completion may take (default: --max-new-tokens)")),
    ("--save-every", "save_every", dict(type=int, metavar="N", help="a checkpoint every N steps (always one at the "
                                        "end and on Ctrl-C)")),
    ("--save-total-limit", "save_total_limit", dict(type=int, metavar="N", help="keep at most N checkpoints, the "
                                                    "oldest removed first, never the latest nor the --save-best "
                                                    "model's step (as transformers' Trainer; default: every one)")),
    ("--save-best", "save_best", dict(metavar="METRIC", help="after each evaluation better by METRIC than every "
                                      "earlier one (eval_accuracy, eval_reverse_kl, ...: the direction is the "
                                      "figure's), write the student to best/, with best.json naming the step")),
    ("--resume", "resume", dict(metavar="DIR", help="continue a run from its latest checkpoint, exactly, into DIR "
                                "(unless --output-dir names another directory)")),
    ("--overwrite", "overwrite", dict(action="store_true", default=None, help="start over in an --output-dir that "
                                      "holds a run: what it wrote (metrics, checkpoints, model) is removed first; "
                                      "without it such a directory is refused")),
    ("--gradient-checkpointing", "gradient_checkpointing", dict(
        action="store_true", default=None, help="recompute the student's layer activations in the backward pass "
        "instead of keeping them (transformers' gradient checkpointing): less memory for long responses, about a "
        "third more compute; any ZeRO stage, LoRA too")),
    ("--max-skipped-steps", "max_skipped_steps", dict(type=int, metavar="N", help="stop, with a checkpoint, after N "
                                                      "optimizer steps in a row skipped for a non-finite loss or "
                                                      "gradient (default 20; exit status 5)")),
    ("--collective-timeout", "collective_timeout", dict(type=float, metavar="SECONDS", help="how long a rank waits "
                                                          "for another at a collective before it fails: how soon "
                                                          "the others stop when one dies (default 600, or more "
                                                          "with a long --teacher-timeout)")),
    ("--lora-rank", "lora_rank", dict(type=int, metavar="R", help="train LoRA adapters (PEFT) of rank R on the "
                                      "student instead of every weight; model/ is then a PEFT adapter directory")),
    ("--lora-alpha", "lora_alpha", dict(type=float, metavar="A", help="LoRA's alpha: updates scaled by A / R "
                                        "(default 2 x R)")),
    ("--lora-targets", "lora_targets", dict(metavar="NAMES", help="comma list of the layers the adapters wrap, "
                                            "e.g. q_proj,v_proj (default all-linear: every linear layer but the "
                                            "output head); each must match a layer of the student")),
    ("--merge-lora", "merge_lora", dict(action="store_true", default=None, help="also write the merged model "
                                        "(adapters folded into the weights) to merged/")),
]
DEFAULT_RUN_FLAGS = ("student", "teacher", "teacher_url", "prompts")
"""With none of these (and objective opsd), ``train`` is the built-in run."""


def add_train_parser(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    train = sub.add_parser(
        "train", parents=[common], help="train a student by on-policy distillation (or SFT) into a checkpoint",
        description="Train a student on DeepSpeed by on-policy distillation from a prompt file to a checkpoint: "
        "metrics.jsonl, DeepSpeed's monitors, checkpoints/ (exact --resume), model/ and eval.png in --output-dir. "
        "With no --student, --teacher, --teacher-url or --prompts: the built-in run, a real one on the Python "
        "documentation that ships with Python: a teacher trained on it by SFT (cached in --cache-dir), distilled "
        "into a smaller student.")
    train.add_argument("--output-dir", metavar="DIR", help="where the run writes (needed, unless --resume DIR: "
                       "then DIR); one that holds another run is refused unless --overwrite")
    for flag, dest, kwargs in FLAGS:
        train.add_argument(flag, dest=dest, **kwargs)
    train.add_argument("--cache-dir", metavar="DIR", help="where the built-in run keeps the teachers it trains "
                       "(default $OPSD_ROLLOUT_CACHE or ~/.cache/opsd-rollout)")
    train.add_argument("--quiet", action="store_true", help="no progress line")
    train.set_defaults(func=run_train)
    return train


NOT_RESUMED = {"--resume": True, "--teacher-api-key": True, "--overwrite": False}
"""Flags the command that continues a run leaves out, each -> whether it takes a value: the old ``--resume`` (one
naming the run is added), the served teacher's key (never printed: ``$OPSD_ROLLOUT_API_KEY`` passes it) and
``--overwrite`` (which would remove the run to continue)."""


def resume_command(argv: list[str], output_dir: Any) -> str:
    """The command that continues a run: ``argv`` as given, less ``NOT_RESUMED``'s flags and the ``--local_rank`` a
    launcher gave this rank (the same launcher gives it again), with ``--resume`` naming the run."""
    dropped = {**NOT_RESUMED, **dict.fromkeys(LOCAL_RANK_FLAGS, True)}
    kept, skip = [], False
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif flag in dropped:
            skip = dropped[flag] and "=" not in arg
        else:
            kept.append(arg)
    return shlex.join(["opsd-rollout", *kept, "--resume", str(output_dir)])


def continue_with(argv: list[str], output_dir: Any, launched: bool = False) -> str:
    """What the messages of a stopped run end with: the command that continues it, on its own last line (copied
    verbatim), said to want the same launcher when the run had several ranks, and the served teacher's key in the
    environment when the run was given one."""
    notes = ["under the same launcher"] if launched else []
    if any(arg.split("=", 1)[0] == "--teacher-api-key" for arg in argv):
        notes.append(f"the server key in ${KEY_VARIABLE}")
    said = f" ({'; '.join(notes)})" if notes else ""
    return f"continue with{said}:\n  " + resume_command(argv, output_dir)


def output_dir_of(args: argparse.Namespace) -> str:
    """``--output-dir``, or the run ``--resume`` continues."""
    if args.output_dir is not None:
        return args.output_dir
    if args.resume is None:
        raise ValueError("--output-dir DIR is needed: where the run writes (--resume DIR alone continues that run "
                         "in DIR)")
    from opsd_rollout.train.run_dir import resumed_output_dir

    return resumed_output_dir(args.resume)


def run_train(args: argparse.Namespace) -> int:
    from opsd_rollout.train.faults import exit_status, signal_name  # light
    from opsd_rollout.train.preflight import preflight  # light: before torch loads

    given = {dest: getattr(args, dest) for _flag, dest, _kw in FLAGS if getattr(args, dest) is not None}
    builtin = not any(name in given for name in DEFAULT_RUN_FLAGS) and given.get("objective", "opsd") == "opsd"
    output_dir = output_dir_of(args)
    preflight({**given, "output_dir": output_dir}, builtin=builtin)

    if given.get("device") == "cpu":  # DeepSpeed picks its accelerator once, when first imported: the CPU, asked
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.verbose:  # DeepSpeed's CPU-fallback line, logged as it is first imported, shown (-v): the package's
        import deepspeed  # noqa: F401  names below import it quietly, as they do for the library's callers
    from opsd_rollout.train import TrainConfig, train  # heavy: see the module docstring
    from opsd_rollout.train.default import default_run, task_flags

    if builtin:  # quiet as the library is, transformers' progress bars included, unless -v
        result = default_run(output_dir, cache_dir=args.cache_dir, progress=not args.quiet,
                             overrides={"verbose": args.verbose, **given})
    else:
        if "task" in given:  # responses as long as its solutions, scored on its held-out problems
            given = {**task_flags(args.cache_dir, given["task"]), **given}
        result = train(TrainConfig.from_flat({"output_dir": output_dir, "progress": not args.quiet,
                                              "verbose": args.verbose, **given}))
    status = exit_status(result)
    if int(os.environ.get("RANK", "0")) != 0:  # under a launcher, rank 0 speaks; every rank exits alike
        return status
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if result.interrupted and result.fault is None:
        print(f"opsd-rollout: {signal_name(result.signal)}: stopped at step {result.steps}; checkpoint "
              f"{result.checkpoint}; " + continue_with(args.argv, result.output_dir, launched), file=sys.stderr)
        return status
    if result.stopped is not None:
        retried = (f" (each request is retried for --teacher-timeout, "
                   f"{given.get('teacher_timeout', DEFAULTS['timeout']):g} s)" if result.fault == "teacher" else "")
        when = {"teacher": "once the teacher server answers, ", "checkpoint": "once it can be written, "}
        print(f"opsd-rollout: stopped after step {result.steps}: {result.stopped}{retried}\ncheckpoint "
              f"{result.checkpoint}; {when.get(result.fault, '')}"
              + continue_with(args.argv, result.output_dir, launched), file=sys.stderr)
        return status
    curve = result.eval_curve()
    if curve:
        (first_step, first), (last_step, last) = curve[0], curve[-1]
        print(f"held-out reverse KL to the teacher: {first:.4f} at step {first_step} -> {last:.4f} at step "
              f"{last_step} ({last / first:.2f}x)" if first else "")
    accuracy = result.eval_curve("eval_accuracy")
    if accuracy:
        teacher = result.records[0].get("teacher_eval_accuracy") if result.records else None
        print(f"task accuracy: {accuracy[0][1]:.1%} at step {accuracy[0][0]} -> {accuracy[-1][1]:.1%} at step "
              f"{accuracy[-1][0]}" + (f" (teacher {teacher:.1%})" if teacher is not None else ""))
    best = result.best
    print(f"metrics {result.output_dir / 'metrics.jsonl'}, model {result.model_dir}, checkpoint {result.checkpoint}"
          + (f", best model {result.output_dir / 'best'} (step {best.step}, {best.metric} {best.value:.4g})"
             if best is not None and best.step is not None else "")
          + (f", merged model {result.merged_dir}" if result.merged_dir else "")
          + (f", plot {result.plot}" if result.plot else ""))
    return 0
