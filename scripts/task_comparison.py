"""Losses compared on the built-in arithmetic task at equal optimizer steps and equal wall time (issue 36, part 6;
benchmarks/RESULTS.md "A student judged by accuracy"):

    python scripts/task_comparison.py --cache-dir /tmp/ax36/cache --runs /tmp/ax36/arms
    python scripts/task_comparison.py --cache-dir /tmp/ax36/cache --runs /tmp/ax36/arms --report-only

The student of every arm is the built-in task student's (``default.ARITHMETIC_STUDENT``: ``llama-tiny`` from random
weights, 32 prompts a step, lr 1.5e-3, 80 new tokens, greedy accuracy on the 500 held-out problems every 200 steps),
the teacher the cached built-in teacher (``<cache-dir>/teachers/llama-micro-*/model``, trained by
``opsd-rollout train --task arithmetic``), the arms:

- ``forward_kl``: on-policy, the forward KL (the built-in student's loss);
- ``jsd``: on-policy, the JSD (beta 0.5);
- ``reverse_kl_k1`` / ``reverse_kl_k3``: on-policy, the sampled reverse KL with the k1 / k3 estimator;
- ``supervised_kd``: the teacher's responses to the training prompts, sampled ONCE beforehand (temperature 1, one a
  prompt) by our rollout engine into a prompt file (``sample_record``: one that ended at the teacher's EOS a whole
  response, trained with that EOS after it; one cut at 80 tokens a continuation, trained with none), then ``--lmbda
  0 --loss forward_kl``: the forward KL to the teacher's whole distribution on each token of those fixed responses.
  The generation's wall time is added to the arm's wall-time axis;
- ``sft``: cross-entropy on the task's worked solutions (``--objective sft``);
- ``gkd_mix`` (the recipe's comparison only): GKD's mix, ``--lmbda 0.5 --loss jsd`` on supervised KD's prompt file:
  each step draws the student's own samples (on-policy JSD) or the teacher's samples made once (the JSD on them).

Runs are repeatable (the seed), their times are not: on a shared machine run a pair again with another ``--runs``
directory, and take a run from it into the report with ``--reuse ARM=DIR``.

Every arm runs as its own ``opsd-rollout train`` process with ``OMP_NUM_THREADS`` (``--threads``, default 1), at most
``--parallel`` (default 2) at once; an arm whose run directory already holds a finished run is read, not rerun
(``--reuse ARM=DIR`` takes a run made elsewhere). The wall-time axis is the run's own ``time/steps_s`` (the optimizer
steps' wall time, evaluations and start-up left out, the same for every arm) plus, for supervised KD, the
generation's. Writes ``benchmarks/task/comparison.json`` (atomically; ``kind: task_comparison``, ``version``: the
document ``scripts/task_comparison.schema.json`` describes) and ``benchmarks/task/comparison.png`` (accuracy against
the optimizer step and against wall time, the teacher's level drawn). It is not a benchmark result for ``compare``: its
figures are accuracies at evaluation steps of single runs, not repeated timings.

Adding an arm: an ``Arm`` in ``ARMS`` (its label and ``train`` flags; whether it distils from the teacher, and whether it
trains on the teacher's samples made once); the report and the plot take it as it comes.

The recipe practitioners run (issue 49): ``--labelled N --warm-steps W`` keeps the worked solutions of the task's first
N training problems (the rest are prompts alone), warm-starts the student by SFT on them for W steps, once a seed, and
runs every arm from that warm start (``--student`` its model, a fresh optimizer at ``--lr``) for ``--steps`` more:
continued SFT on the labelled set, supervised KD on the teacher's samples for the unlabelled prompts (made once), the
on-policy losses on every prompt, and self-distillation (``--teacher self``, the reference in the teacher's context,
on the labelled set). The warm start SFTs each labelled problem twice, as the student sees it and with its solution
filled into the self-teacher's context (``--teacher-context``'s default), so that the small model learns to read
that form; every arm starts from this one warm start. ``--seeds 0,1`` repeats it all per seed. Writes
``recipe_comparison.json`` (``version`` 2: each seed's arms as version 1 has them) and ``recipe_comparison.png``::

    python scripts/task_comparison.py --task arithmetic --labelled 300 --warm-steps 600 --warm-lr 3e-3 --steps 200 \
        --lr 3e-4 --eval-every 50 --prompts-per-micro-batch 16 --eval-prompts 200 --seeds 0,1 \
        --arms sft,supervised_kd,reverse_kl_topk,jsd,forward_kl,reverse_kl_k1,self_distillation \
        --cache-dir CACHE --runs RUNS --out OUT

(what made benchmarks/task/recipe-arithmetic/ and, with ``--task arithmetic-5d``, recipe-arithmetic-5d/; RESULTS,
"The recipe from a warm start").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "task"

DOCUMENT = {"kind": "task_comparison", "version": 1}
"""What the written document says it is (``scripts/task_comparison.schema.json`` describes this version)."""


@dataclass(frozen=True)
class Arm:
    """One way of training the student, run as one ``opsd-rollout train``."""

    label: str
    flags: tuple[str, ...]
    """Its ``train`` flags beside the common ones (``common_flags``)."""
    teacher: bool = True
    """It distils from the cached teacher (``--teacher``); SFT learns from the references alone."""
    teacher_samples: bool = False
    """It trains on the teacher's responses to the training prompts, sampled once beforehand (``generate``), whose
    generation time counts in its wall time."""
    self_teacher: bool = False
    """The student is its own teacher (``--teacher self``), shown each labelled problem's solution."""
    recipe: bool = False
    """Only in the recipe's comparison (``--warm-steps``): from a random student it has nothing to stand on."""


ON_POLICY = ("--task", "{task}", "--lmbda", "1")
ARMS: dict[str, Arm] = {
    "forward_kl": Arm("on-policy forward KL", (*ON_POLICY, "--loss", "forward_kl")),
    "jsd": Arm("on-policy JSD", (*ON_POLICY, "--loss", "jsd")),
    "reverse_kl_k1": Arm("on-policy sampled reverse KL, k1",
                         (*ON_POLICY, "--loss", "sampled_reverse_kl", "--estimator", "k1")),
    "reverse_kl_k3": Arm("on-policy sampled reverse KL, k3",
                         (*ON_POLICY, "--loss", "sampled_reverse_kl", "--estimator", "k3")),
    "supervised_kd": Arm("supervised KD on teacher samples made once", ("--lmbda", "0", "--loss", "forward_kl"),
                         teacher_samples=True),
    "gkd_mix": Arm("GKD's mix: on-policy JSD half the steps, the teacher's samples the rest",
                   ("--lmbda", "0.5", "--loss", "jsd"), teacher_samples=True, recipe=True),
    "sft": Arm("SFT on the references", ("--task", "{task}", "--objective", "sft"), teacher=False),
    "reverse_kl_topk": Arm("on-policy reverse KL, top-64", (*ON_POLICY, "--loss", "reverse_kl", "--teacher-cache", "topk",
                                                             "--teacher-top-k", "64", "--top-k-rest", "tail"),
                           recipe=True),
    "self_distillation": Arm("self-distillation, the reference in context",
                             ("--task", "{task}", "--loss", "reverse_kl", "--self-teacher", "initial"), teacher=False,
                             self_teacher=True, recipe=True),
}
"""The arms, by name (``--arms``)."""

GENERATION = dict(temperature=1.0, max_new_tokens=80, batch_size=128, seed=0)
"""Supervised KD's teacher samples: sampled at temperature 1, one a training prompt, from a fixed seed."""


def student_settings(steps: int, task: str = "arithmetic", lr: float | None = None, eval_every: int | None = None,
                     prompts_per_micro_batch: int | None = None, eval_prompts: int | None = None) -> dict[str, Any]:
    from opsd_rollout.train.default import ARITHMETIC_STUDENT
    from opsd_rollout.train.tasks import response_tokens

    s = ARITHMETIC_STUDENT
    return dict(student=s["student"], steps=steps,
                prompts_per_micro_batch=prompts_per_micro_batch or s["prompts_per_micro_batch"], lr=lr or s["lr"],
                eval_every=eval_every or s["eval_every"], eval_prompts=eval_prompts or s["eval_prompts"],
                max_new_tokens=max(s["max_new_tokens"], response_tokens(task)), seed=0)


def common_flags(settings: dict[str, Any]) -> list[str]:
    return ["--student", settings["student"], "--steps", str(settings["steps"]), "--prompts-per-micro-batch",
            str(settings["prompts_per_micro_batch"]), "--lr", str(settings["lr"]), "--eval-every",
            str(settings["eval_every"]), "--eval-prompts", str(settings["eval_prompts"]), "--max-new-tokens",
            str(settings["max_new_tokens"]), "--seed", str(settings["seed"]), "--quiet"]


def cached_teacher(cache_dir: Path, task: str = "arithmetic") -> Path:
    """The task's built-in teacher in ``cache_dir`` (trained by ``opsd-rollout train --task TASK``)."""
    from opsd_rollout.train.default import RUNS, teacher_dir

    model = teacher_dir(str(cache_dir), RUNS[task][0]) / "model"
    if not model.is_dir():
        sys.exit(f"no built-in {task} teacher in {model.parent}: run opsd-rollout train --task {task} --cache-dir "
                 f"{cache_dir} first (it trains the teacher, then its student)")
    return model


def eval_file(cache_dir: Path, task: str = "arithmetic") -> Path:
    from opsd_rollout.train.default import task_eval_flags

    return Path(task_eval_flags(str(cache_dir), task)["eval_data"])


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_json_atomic(path: Path, data: Any) -> None:
    from opsd_rollout.files import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


# ---- supervised KD's teacher samples ----------------------------------------------------------------------------

def teacher_responses(teacher: Path, problems: list[Any]) -> list[str]:
    """The teacher's sampled response to each problem's prompt, as text up to and with its EOS (none where it ran
    out of tokens)."""
    import torch
    from deepspeed.runtime.rollout.base import SamplingConfig

    from opsd_rollout.models import load_model
    from opsd_rollout.rollout import HybridEngineRollout
    from opsd_rollout.train.data import Encoder, Example

    model, tokenizer = load_model(str(teacher))
    model.eval()
    rollout = HybridEngineRollout(model, tokenizer)
    encoder = Encoder(tokenizer, max_prompt_tokens=1 << 30, max_reference_tokens=GENERATION["max_new_tokens"])
    sampling = SamplingConfig(max_new_tokens=GENERATION["max_new_tokens"], temperature=GENERATION["temperature"])
    eos, size, out = tokenizer.eos_token, GENERATION["batch_size"], []
    try:
        for index in range(0, len(problems), size):
            chunk = problems[index:index + size]
            with torch.no_grad():
                batch = rollout.generate(encoder.request([Example(p.prompt) for p in chunk], torch.device("cpu")),
                                         sampling, seed=GENERATION["seed"] + index)
            first = int(batch.response_start_idx[0])
            for row, keep in zip(batch.input_ids[:, first:], batch.attention_mask[:, first:]):
                text = tokenizer.decode(row[keep.bool()].tolist(), skip_special_tokens=False)
                out.append(text[:text.index(eos) + len(eos)] if eos in text else text)
            if (index // size) % 20 == 0:
                print(f"generated {index + len(chunk)}/{len(problems)}", flush=True)
    finally:
        rollout.shutdown()
    return out


def sample_record(prompt: str, text: str, eos: str) -> dict[str, Any]:
    """A teacher's sample (``text``, with the EOS's text where it ended) as a prompt file's line: a sample that
    ended is a whole response, its reference the text before the EOS (training puts the EOS back after it, so the
    student learns to stop); one cut at ``max_new_tokens`` did not end, and says so (``"continuation": true``:
    trained with no EOS after it)."""
    if text.endswith(eos):
        return {"prompt": prompt, "reference": text[:-len(eos)]}
    return {"prompt": prompt, "reference": text, "continuation": True}


def generate(teacher: Path, path: Path, task: str = "arithmetic", labelled: int | None = None,
             unlabelled: int | None = None) -> None:
    """The teacher's responses to the task's training prompts (with ``labelled``: to its unlabelled prompts alone,
    the ones after the labelled set), sampled once, as a prompt file (``sample_record``). The held-out problems'
    responses fill every 10th line (the lines a prompt file's run holds out), so the run trains on exactly the
    training prompts the other arms do, in the same order. The wall time goes to ``<path>.json``."""
    from opsd_rollout.files import write_text_atomic
    from opsd_rollout.models import load_tokenizer
    from opsd_rollout.train.scorers import extract
    from opsd_rollout.train.setup import HELD_OUT_EVERY
    from opsd_rollout.train.tasks import TASKS

    start, load_start = time.perf_counter(), load()
    eos = load_tokenizer(str(teacher)).eos_token
    train, held_out = TASKS[task].problems()
    if labelled is not None:
        train = train[labelled:] if unlabelled is None else train[labelled:labelled + unlabelled]
    train_texts, held_texts = teacher_responses(teacher, train), teacher_responses(teacher, held_out)
    lines, taken, held = [], 0, 0
    while taken < len(train):
        if len(lines) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            p, text, held = held_out[held % len(held_out)], held_texts[held % len(held_out)], held + 1
        else:
            p, text, taken = train[taken], train_texts[taken], taken + 1
        lines.append(json.dumps(sample_record(p.prompt, text, eos)))
    write_text_atomic(path, "\n".join(lines) + "\n")
    right = sum(extract("gsm8k", t.replace(eos, "")) == str(p.answer) for p, t in zip(train, train_texts))
    stopped = sum(t.endswith(eos) for t in train_texts)
    write_json_atomic(path.with_suffix(".json"), dict(
        seconds=round(time.perf_counter() - start, 1), teacher=str(teacher), task=task, **GENERATION,
        prompts=len(train), held_out=len(held_out), samples_correct=right / len(train),
        samples_ending_in_eos=stopped / len(train), threads=os.environ.get("OMP_NUM_THREADS"), load_start=load_start,
        load_end=load()))


def write_warm_start_file(path: Path, task: str, labelled: int) -> None:
    """The warm start's prompt file: each of the task's first ``labelled`` problems twice, as the student sees it and
    with its solution filled into the self-teacher's context (``DEFAULT_CONTEXT``: a small model never saw a solution
    in its prompt, and learns to read one here), then its solution; a held-out problem fills every 10th line (the
    lines a prompt file's run holds out), so the warm start trains on the labelled set alone."""
    from opsd_rollout.files import write_text_atomic
    from opsd_rollout.train.setup import HELD_OUT_EVERY
    from opsd_rollout.train.tasks import TASKS
    from opsd_rollout.train.teacher_spec import DEFAULT_CONTEXT, fill

    train, held_out = TASKS[task].problems()
    pairs = [(p.prompt, p.reference) for p in train[:labelled]]
    pairs += [(fill(DEFAULT_CONTEXT, prompt=p.prompt, reference=p.reference), p.reference) for p in train[:labelled]]
    lines, taken, held = [], 0, 0
    while taken < len(pairs):
        if len(lines) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1:
            p, held = held_out[held % len(held_out)], held + 1
            lines.append(json.dumps({"prompt": p.prompt, "reference": p.reference}))
        else:
            prompt, reference = pairs[taken]
            taken += 1
            lines.append(json.dumps({"prompt": prompt, "reference": reference}))
    write_text_atomic(path, "\n".join(lines) + "\n")


# ---- the runs -----------------------------------------------------------------------------------------------------

def finished(run: Path, steps: int) -> bool:
    metrics = run / "metrics.jsonl"
    return metrics.is_file() and any(json.loads(line).get("step") == steps and "eval_accuracy" in json.loads(line)
                                     for line in metrics.read_text().splitlines() if line.strip())


@dataclass(frozen=True)
class Recipe:
    """Where the arms start and what they see: the task, its labelled set and the warm start (``labelled`` None and
    ``warm_steps`` 0: issue 36's setting, every problem labelled, a random student)."""

    task: str = "arithmetic"
    labelled: int | None = None
    unlabelled: int | None = None
    warm_steps: int = 0
    warm_lr: float | None = None

    def split_flags(self) -> list[str]:
        flags = [] if self.labelled is None else ["--task-labelled", str(self.labelled)]
        return flags + ([] if self.unlabelled is None else ["--task-unlabelled", str(self.unlabelled)])


def arm_flags(name: str, settings: dict[str, Any], recipe: Recipe, teacher: Path, samples: Path, eval_path: Path,
              student: Path | None) -> list[str]:
    """Arm ``name``'s ``train`` flags: its own, the common ones, its teacher, its data (the task and its split, or
    the teacher's samples), and the warm-started ``student`` when there is one."""
    arm = ARMS[name]
    flags = [f.format(task=recipe.task) for f in arm.flags] + common_flags(settings)
    if student is not None:
        flags[flags.index("--student") + 1] = str(student)
    if "--task" in flags:
        flags += recipe.split_flags()
    if arm.teacher_samples:
        flags += ["--prompts", str(samples), "--eval-data", str(eval_path), "--eval-scorer", "gsm8k"]
    if arm.self_teacher:
        flags += ["--teacher", "self"]
    elif arm.teacher:
        flags += ["--teacher", str(teacher)]
    return flags


def run_train(out: Path, log: Path, flags: list[str], threads: int, samples: list[tuple[float, list[float]]],
              prepare: Any = None) -> None:
    """One ``opsd-rollout train`` into ``out`` (``prepare``: a command to run first, e.g. the teacher's samples),
    with what it ran and the load around it in ``<out>.run.json``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    info: dict[str, Any] = dict(threads=threads, load_start=load(), started=time.time())
    with open(log, "a") as handle:
        if prepare is not None:
            subprocess.run(prepare, env=env, stdout=handle, stderr=subprocess.STDOUT, check=True)
        command = [sys.executable, "-m", "opsd_rollout", "train", "--output-dir", str(out), *flags]
        handle.write(" ".join(command) + "\n")
        handle.flush()
        start = time.perf_counter()
        code = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    info.update(returncode=code, process_seconds=round(time.perf_counter() - start, 1), load_end=load(),
                command=command[1:])
    ended = time.time()
    during = [s for t, s in samples if info["started"] <= t <= ended]
    info["load_1min_during"] = dict(min=min(s[0] for s in during), max=max(s[0] for s in during),
                                    mean=round(sum(s[0] for s in during) / len(during), 2)) if during else None
    write_json_atomic(out.parent / f"{out.name}.run.json", info)
    print(f"{out.name}: exit {code} in {info['process_seconds']} s", flush=True)


def warm_start(runs: Path, settings: dict[str, Any], recipe: Recipe, eval_path: Path, threads: int,
               samples: list[tuple[float, list[float]]]) -> Path:
    """The seed's warm start (``recipe.warm_steps`` SFT steps on the labelled set, twice over: ``write_warm_start_file``),
    run once: its model, which every arm of the seed starts from."""
    out = runs / "warm_start"
    if not finished(out, recipe.warm_steps):
        data = runs.parent / "warm_start.jsonl"
        if not data.is_file():
            write_warm_start_file(data, recipe.task, recipe.labelled)
        warm = dict(settings, steps=recipe.warm_steps, lr=recipe.warm_lr or settings["lr"],
                    eval_every=recipe.warm_steps)
        run_train(out, runs / "warm_start.log", ["--objective", "sft", "--prompts", str(data), "--eval-data",
                                                  str(eval_path), "--eval-scorer", "gsm8k", *common_flags(warm)],
                  threads, samples)
    return out / "model"


def run_arms(names: list[str], runs: Path, settings: dict[str, Any], threads: int, parallel: int,
             teacher: Path, eval_path: Path, recipe: Recipe = Recipe()) -> None:
    samples: list[tuple[float, list[float]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.time(), load()))
            done.wait(15)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    runs.mkdir(parents=True, exist_ok=True)
    student = warm_start(runs, settings, recipe, eval_path, threads, samples) if recipe.warm_steps else None
    teacher_samples = runs.parent / "teacher_samples.jsonl" if recipe.warm_steps else runs / "teacher_samples.jsonl"
    todo = [n for n in names if not finished(runs / n, settings["steps"])]
    print("to run:", todo or "none", flush=True)

    def one(name: str) -> None:
        prepare = None
        if ARMS[name].teacher_samples and not teacher_samples.with_suffix(".json").is_file():
            prepare = [sys.executable, __file__, "--generate", str(teacher), str(teacher_samples), "--task",
                       recipe.task, *(["--labelled", str(recipe.labelled)] if recipe.labelled is not None else []),
                       *(["--unlabelled", str(recipe.unlabelled)] if recipe.unlabelled is not None else [])]
        flags = arm_flags(name, settings, recipe, teacher, teacher_samples, eval_path, student)
        run_train(runs / name, runs / f"{name}.log", flags, threads, samples, prepare)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for future in [pool.submit(one, n) for n in todo]:
            future.result()
    done.set()


# ---- the report ---------------------------------------------------------------------------------------------------

def curve(run: Path, extra_seconds: float) -> tuple[list[dict[str, Any]], float | None]:
    points, teacher = [], None
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("teacher_eval_accuracy") is not None:
            teacher = record["teacher_eval_accuracy"]
        if "eval_accuracy" in record:
            seconds = record.get("time/steps_s", 0.0) if record["step"] else 0.0
            points.append(dict(step=record["step"], accuracy=record["eval_accuracy"],
                               unextractable=record.get("eval_unextractable"),
                               reverse_kl=record.get("eval_reverse_kl"),
                               train_seconds=round(seconds, 1), wall_seconds=round(seconds + extra_seconds, 1)))
    return points, teacher


def at_time(points: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The last evaluation at or before ``seconds`` (none: supervised KD's teacher samples not yet made)."""
    before = [p for p in points if p["wall_seconds"] <= seconds + 1e-9]
    return before[-1] if before else dict(step=None, accuracy=None)


def report(runs: Path, names: list[str], reuse: dict[str, Path], settings: dict[str, Any], threads: int,
           parallel: int, teacher: Path, eval_path: Path, task: str = "arithmetic",
           generation: Path | None = None) -> dict[str, Any]:
    arms, teacher_level = {}, None
    generation = generation or runs / "teacher_samples.json"
    for name in names:
        run = reuse.get(name, runs / name)
        extra = 0.0
        if ARMS[name].teacher_samples and generation.is_file():
            extra = json.loads(generation.read_text())["seconds"]
        points, level = curve(run, extra)
        teacher_level = teacher_level if level is None else level
        info_path = run.parent / f"{name}.run.json"  # what run_arm recorded, where it ran the arm
        arms[name] = dict(label=ARMS[name].label, run=str(run), points=points, generation_seconds=extra or None,
                          process=json.loads(info_path.read_text()) if info_path.is_file() else None,
                          config=json.loads((run / "train_config.json").read_text()))
    equal_steps = min(a["points"][-1]["step"] for a in arms.values())
    ends = {name: arm["points"][-1]["wall_seconds"] for name, arm in arms.items()}
    equal_time = min(ends.values())
    half = teacher_level / 2 if teacher_level is not None else None
    for arm in arms.values():
        points = arm["points"]
        reached = next((p for p in points if half is not None and p["accuracy"] >= half), None)
        arm["summary"] = dict(
            accuracy_at_equal_steps=next(p["accuracy"] for p in points if p["step"] == equal_steps),
            accuracy_at_equal_time=at_time(points, equal_time)["accuracy"],
            step_at_equal_time=at_time(points, equal_time)["step"],
            final_accuracy=points[-1]["accuracy"], final_wall_seconds=points[-1]["wall_seconds"],
            half_teacher_step=reached and reached["step"],
            half_teacher_wall_seconds=reached and reached["wall_seconds"],
            accuracy_at_each_arms_end={other: at_time(points, ends[other])["accuracy"] for other in arms})
    return dict(
        **DOCUMENT, task=task, teacher=str(teacher), teacher_eval_accuracy=teacher_level, eval_data=str(eval_path),
        eval_problems=sum(1 for _ in open(eval_path)), scorer="gsm8k", settings=settings, threads=threads,
        parallel=parallel, equal_steps=equal_steps, equal_wall_seconds=equal_time,
        wall_time_axis="the run's time/steps_s (optimizer steps' wall time; evaluations and start-up left out), "
                       "plus the teacher samples' generation for the arms trained on them",
        generation={**GENERATION, "record": json.loads(generation.read_text())} if generation.is_file() else None,
        machine=dict(cpus=os.cpu_count(), processor=platform.processor() or platform.machine(),
                     python=platform.python_version()),
        arms=arms)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from opsd_rollout.files import save_figure_atomic

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.2), squeeze=False)
    for axis, key, label in ((axes[0][0], "step", "optimizer step"),
                             (axes[0][1], "wall_seconds", "wall time (s): optimizer steps, + generation for KD")):
        for arm in result["arms"].values():
            points = arm["points"]
            axis.plot([p[key] for p in points], [p["accuracy"] for p in points], marker="o", markersize=3,
                      label=arm["label"])
        if result["teacher_eval_accuracy"] is not None:
            axis.axhline(result["teacher_eval_accuracy"], color="black", linestyle="--", linewidth=1,
                         label=f"teacher ({result['teacher_eval_accuracy']:.1%})")
            axis.axhline(result["teacher_eval_accuracy"] / 2, color="grey", linestyle=":", linewidth=1,
                         label="half the teacher's")
        axis.set_xlabel(label)
        axis.set_ylabel("held-out greedy accuracy")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(f"arithmetic task: {result['settings']['student']} students, {result['eval_problems']} held-out "
                    f"problems ({result['threads']} thread each, {result['parallel']} runs at once, "
                    f"{result['machine']['cpus']} cores)", fontsize=10)
    figure.tight_layout()
    save_figure_atomic(figure, path, dpi=100)
    plt.close(figure)


RECIPE_DOCUMENT = {"kind": "task_comparison", "version": 2}
"""The recipe's comparison: every seed's arms as a version-1 document has them, beside the warm starts."""


def recipe_report(runs: Path, names: list[str], seeds: list[int], settings: dict[str, Any], threads: int,
                  parallel: int, teacher: Path, eval_path: Path, recipe: Recipe) -> dict[str, Any]:
    """Each seed's report (``report``, its arms from its warm start), each warm start's accuracy and time, and per arm
    its accuracy at equal steps and at equal wall time on every seed."""
    by_seed, warm = {}, {}
    for seed in seeds:
        seed_runs = runs / f"seed{seed}"
        by_seed[str(seed)] = report(seed_runs, names, {}, dict(settings, seed=seed), threads, parallel, teacher,
                                    eval_path, recipe.task, runs / "teacher_samples.json")
        points, _ = curve(seed_runs / "warm_start", 0.0)
        warm[str(seed)] = dict(accuracy=points[-1]["accuracy"], train_seconds=points[-1]["train_seconds"],
                               steps=points[-1]["step"])
    levels = [r["teacher_eval_accuracy"] for r in by_seed.values() if r["teacher_eval_accuracy"] is not None]
    table = {name: {seed: dict(at_equal_steps=r["arms"][name]["summary"]["accuracy_at_equal_steps"],
                               at_equal_time=r["arms"][name]["summary"]["accuracy_at_equal_time"],
                               final=r["arms"][name]["summary"]["final_accuracy"])
                    for seed, r in by_seed.items()} for name in names}
    return dict(**RECIPE_DOCUMENT, task=recipe.task, labelled=recipe.labelled, unlabelled=recipe.unlabelled,
                warm_steps=recipe.warm_steps, warm_lr=recipe.warm_lr, settings=settings,
                teacher=str(teacher), teacher_eval_accuracy=levels[0] if levels else None, warm_starts=warm,
                table=table, seeds=by_seed)


def recipe_plot(result: dict[str, Any], path: Path) -> None:
    """Accuracy against the optimizer step and against wall time after the warm start, every arm a colour, every seed
    a line style; the teacher's level and the warm starts' drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from opsd_rollout.files import save_figure_atomic

    figure, axes = plt.subplots(1, 2, figsize=(13, 4.6), squeeze=False)
    styles = ["-", "--", ":", "-."]
    names = list(result["table"])
    colours = {name: f"C{i}" for i, name in enumerate(names)}
    for axis, key, label in ((axes[0][0], "step", "optimizer step after the warm start"),
                             (axes[0][1], "wall_seconds", "wall time after the warm start (s), + generation for KD")):
        for index, (seed, seeded_result) in enumerate(result["seeds"].items()):
            for name, arm in seeded_result["arms"].items():
                points = arm["points"]
                axis.plot([p[key] for p in points], [p["accuracy"] for p in points], styles[index % len(styles)],
                          color=colours[name], marker="o", markersize=2.5,
                          label=f"{arm['label']}" if index == 0 else None)
        if result["teacher_eval_accuracy"] is not None:
            axis.axhline(result["teacher_eval_accuracy"], color="black", linestyle="--", linewidth=1,
                         label=f"teacher ({result['teacher_eval_accuracy']:.1%})")
        for warm in result["warm_starts"].values():
            axis.axhline(warm["accuracy"], color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.set_ylabel("held-out greedy accuracy")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    seeds = ", ".join(f"seed {s} {'solid dashed dotted dash-dot'.split()[i % 4]}" for i, s in enumerate(result["seeds"]))
    figure.suptitle(f"{result['task']}: {result['labelled']} labelled problems, a warm start of "
                    f"{result['warm_steps']} SFT steps (grey: its accuracy), then each arm; {seeds}", fontsize=10)
    figure.tight_layout()
    save_figure_atomic(figure, path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, help="the cache of the built-in task run (its teacher, eval file)")
    parser.add_argument("--runs", type=Path, help="a directory for the arms' runs")
    parser.add_argument("--arms", help="comma list of arms (default: all of the setting's)")
    parser.add_argument("--reuse", action="append", default=[], metavar="ARM=DIR", help="a finished run to read")
    parser.add_argument("--task", default="arithmetic", help="the built-in task (default arithmetic)")
    parser.add_argument("--labelled", type=int, help="the recipe: the task's first N problems keep their solutions")
    parser.add_argument("--unlabelled", type=int, help="the recipe: how many prompts follow them (default the rest)")
    parser.add_argument("--warm-steps", type=int, default=0, help="the recipe: SFT steps of the warm start")
    parser.add_argument("--warm-lr", type=float, help="the recipe: the warm start's learning rate (default --lr)")
    parser.add_argument("--seeds", default="0", help="comma list of seeds (the recipe: a warm start each)")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, help="the arms' learning rate (default the built-in student's)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations (default the built-in student's)")
    parser.add_argument("--prompts-per-micro-batch", type=int,
                        help="prompts a step of every arm and the warm start (default the built-in student's)")
    parser.add_argument("--eval-prompts", type=int, help="held-out problems an evaluation (default the built-in student's)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every arm (default 1)")
    parser.add_argument("--parallel", type=int, default=2, help="arms at once (default 2)")
    parser.add_argument("--report-only", action="store_true", help="read the runs, run nothing")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--generate", nargs=2, metavar=("TEACHER", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        generate(Path(args.generate[0]), Path(args.generate[1]), args.task, args.labelled, args.unlabelled)
        return
    if args.cache_dir is None or args.runs is None:
        parser.error("--cache-dir and --runs are needed")
    recipe = Recipe(args.task, args.labelled, args.unlabelled, args.warm_steps, args.warm_lr)
    if (recipe.labelled is None) != (recipe.warm_steps == 0):
        parser.error("the recipe's comparison takes --labelled and --warm-steps together")
    names = (args.arms.split(",") if args.arms else
             [n for n, arm in ARMS.items() if recipe.warm_steps or not arm.recipe])
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}: choose from {list(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    reuse = {k: Path(v) for k, v in (r.split("=", 1) for r in args.reuse)}
    settings = student_settings(args.steps, args.task, args.lr, args.eval_every, args.prompts_per_micro_batch,
                                args.eval_prompts)
    teacher, eval_path = cached_teacher(args.cache_dir, args.task), eval_file(args.cache_dir, args.task)
    args.runs.mkdir(parents=True, exist_ok=True)
    if recipe.warm_steps:
        if not args.report_only:
            for seed in seeds:
                run_arms(names, args.runs / f"seed{seed}", dict(settings, seed=seed), args.threads, args.parallel,
                         teacher, eval_path, recipe)
        result = recipe_report(args.runs, names, seeds, settings, args.threads, args.parallel, teacher, eval_path,
                               recipe)
        write_json_atomic(args.out / "recipe_comparison.json", result)
        recipe_plot(result, args.out / "recipe_comparison.png")
        for name, row in result["table"].items():
            print(name, row)
        return
    if not args.report_only:
        run_arms([n for n in names if n not in reuse], args.runs, settings, args.threads, args.parallel, teacher,
                 eval_path)
    result = report(args.runs, names, reuse, settings, args.threads, args.parallel, teacher, eval_path, args.task)
    write_json_atomic(args.out / "comparison.json", result)
    plot(result, args.out / "comparison.png")
    for name, arm in result["arms"].items():
        print(name, arm["summary"])


if __name__ == "__main__":
    main()
