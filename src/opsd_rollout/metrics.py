"""Every figure a profile or a benchmark reports, defined once: its label, its unit, how ranks merge it and
which way is better. The profile's attributed phases, the stage breakdowns, the comparison's metrics and the
multi-rank merge rules are all read from here; a new figure is added here and nowhere else.

A training run's record (``metrics.jsonl``, one line an optimizer step) and the events it sends to DeepSpeed's
monitors are named here too (``TRAINING``): TRL's and HF Trainer's names where they have one (``loss``,
``grad_norm``, ``learning_rate``, ``epoch``, ``eval_*``), every time under ``time/``.

A kernel (the developers' ``scripts/bench_kernels.py``, out of the package) times two implementations of one piece of
work in every iteration: ours (``kernel_ms``) and a baseline (``baseline_ms``: the code we replaced or upstream's),
and their ratio (``speedup``: baseline / ours, per iteration); they are named here so that ``compare`` judges a
kernels result as any other; the baseline is not judged (its speed is not this package's).

Sizes in bytes are written and read here too: ``bytes_text`` for people (messages, summaries), ``size_text`` and
``parse_size`` for flags and result keys (``8MiB``, read back exactly).

Three words, three meanings: an **attributed phase** is work probed inside a rollout (a ZeRO-3 gather,
LoRA fuse, ``gc.collect``); a **forward kind** is ``prefill`` or ``decode``; a **step part** is one part of an
OPSD step (rollout, teacher, student forward, loss, backward, optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MERGES = ("max", "sum", "mean")


@dataclass(frozen=True)
class Metric:
    name: str
    """The profile field (``total_ms``) it is read from."""
    label: str
    """Short, for table columns and plot legends."""
    unit: str
    """``ms``, ``s``, ``bytes``, ``tokens/s``, ``tokens``, ``count``, ``ratio``, ``loss``, ``nats/token``,
    ``epochs``; ``""`` for a pure number (a learning rate, a gradient norm), ``text`` and ``bool`` for the
    training record's labels."""
    merge: str = "max"
    """Across ranks of one run: ``max`` (the slowest rank's time, the largest rank's memory), ``sum``
    (throughput and token counts: each rank rolls out its own prompts) or ``mean`` (ratios, losses, and what
    every rank holds alike: a learning rate, a gradient norm, a figure already reduced over the ranks)."""
    lower_is_better: bool | None = True
    """For comparisons; ``None``: not a performance figure."""
    compared: bool = False
    """``opsd-rollout compare`` judges it by default."""
    monitor: str | None = None
    """Its name in DeepSpeed's monitors (TensorBoard, W&B, CSV) when a training run logs it: ``train/<key>`` as
    HF Trainer's callbacks name a logged key, ``eval/<name>`` for ``eval_<name>``, a ``time/`` key as it is;
    ``None``: not sent there (a label, the step, which is every event's x, or a figure no training run logs)."""
    meaning: str = ""
    """What a training record's key holds, one line (docs/TRAINING.md's table of the keys is made from it)."""


def _ms(name: str, label: str, *, compared: bool = False) -> Metric:
    return Metric(name, label, "ms", compared=compared)


METRICS: dict[str, Metric] = {m.name: m for m in [
    # rollout stages
    _ms("total_ms", "total", compared=True),
    _ms("prompt_expansion_ms", "expand"),
    _ms("generation_ms", "generation"),
    _ms("prefill_ms", "prefill", compared=True),
    _ms("decode_ms", "decode", compared=True),
    _ms("generation_overhead_ms", "gen-other"),
    _ms("post_processing_ms", "post", compared=True),
    _ms("attention_mask_ms", "mask"),
    _ms("ttft_ms", "TTFT", compared=True),
    _ms("tpot_ms", "TPOT", compared=True),
    # attributed phases (inside generation)
    _ms("param_gather_ms", "gather"),
    _ms("inference_cache_ms", "cache"),
    _ms("lora_fuse_ms", "fuse"),
    _ms("lora_unfuse_ms", "unfuse"),
    _ms("gc_ms", "gc"),
    _ms("empty_cache_ms", "empty_cache"),
    _ms("workspace_alloc_ms", "alloc"),
    _ms("compaction_ms", "compact"),
    _ms("compile_ms", "compile"),
    _ms("weight_layout_ms", "weights"),
    _ms("scheduler_ms", "schedule"),
    _ms("kv_placement_ms", "place KV"),
    _ms("cache_management_ms", "cache mgmt"),
    Metric("compiled_graphs", "graphs", "count", merge="sum", lower_is_better=None),
    Metric("reference_ms", "reference", "ms", lower_is_better=None),  # the machine's pace (bench/reference.py), not
    # the code's: never judged; compare notes how far it moved (--pace adjusted: adjusts for it)
    Metric("param_gather_count", "gathers", "count", merge="sum", lower_is_better=None),
    Metric("param_gather_bytes", "gathered", "bytes", merge="sum", lower_is_better=None),
    # throughput and counts
    Metric("tokens_per_second", "tok/s", "tokens/s", merge="sum", lower_is_better=False, compared=True,
           monitor="train/tokens_per_second", meaning="response tokens trained on per second of `time/step_ms`"),
    Metric("decode_tokens_per_second", "decode tok/s", "tokens/s", merge="sum", lower_is_better=False,
           compared=True),
    Metric("prefill_tokens_per_second", "prefill tok/s", "tokens/s", merge="sum", lower_is_better=False),
    Metric("generated_tokens", "tokens", "tokens", merge="sum", lower_is_better=None),
    Metric("padded_tokens", "padding", "tokens", merge="sum", lower_is_better=None),
    Metric("prefill_tokens", "prefill tokens", "tokens", merge="sum", lower_is_better=None),
    Metric("response_tokens", "response tokens", "tokens", merge="sum", lower_is_better=None,
           monitor="train/response_tokens", meaning="real response tokens trained on, over the micro-batches"),
    Metric("effective_batch_size", "rows", "count", merge="sum", lower_is_better=None),
    Metric("batch_size", "prompts", "count", merge="sum", lower_is_better=None),
    Metric("row_steps", "row-steps", "count", merge="sum", lower_is_better=None),
    Metric("live_row_utilisation", "live rows %", "ratio", merge="mean", lower_is_better=False),
    Metric("compactions", "compactions", "count", merge="sum", lower_is_better=None),
    Metric("admission_rounds", "admissions", "count", lower_is_better=None),
    Metric("decode_slots", "slots", "count", merge="sum", lower_is_better=None),
    Metric("peak_active_rows", "peak rows", "count", merge="sum", lower_is_better=None),
    Metric("prefill_forwards", "prefills", "count", lower_is_better=None),
    _ms("row_latency_p50_ms", "row p50"),
    _ms("row_latency_p95_ms", "row p95"),
    _ms("row_latency_max_ms", "row max"),
    # memory
    Metric("peak_memory_bytes", "peak", "bytes", compared=True, monitor="train/peak_memory_bytes",
           meaning="the largest step part's peak (CUDA: allocated by torch; CPU: the process's RSS) over the "
                   "micro-batches"),
    Metric("kv_workspace_bytes", "KV", "bytes"),
    Metric("weight_layout_bytes", "weight copies", "bytes"),
    # OPSD step parts
    _ms("eval_ms", "eval"),
    _ms("rollout_ms", "rollout", compared=True),
    _ms("train_ms", "train"),
    _ms("teacher_forward_ms", "teacher", compared=True),
    _ms("cache_write_ms", "cache write"),
    _ms("teacher_wait_ms", "teacher wait", compared=True),
    _ms("teacher_latency_ms", "teacher latency"),
    Metric("teacher_hidden_share", "teacher hidden %", "ratio", merge="mean", lower_is_better=False),
    _ms("student_forward_ms", "student"),
    _ms("loss_ms", "loss time", compared=True),
    _ms("backward_ms", "backward", compared=True),
    _ms("optimizer_ms", "optim"),
    Metric("rollout_share", "rollout %", "ratio", merge="mean", lower_is_better=None),
    Metric("loss", "loss", "loss", merge="mean", lower_is_better=None, monitor="train/loss",
           meaning="the divergence (SFT: the cross-entropy), the mean over the step's response tokens on every rank"),
    Metric("teacher_cache_bytes", "cache", "bytes", lower_is_better=None, monitor="train/teacher_cache_bytes",
           meaning="the host teacher cache's size, the largest micro-batch's"),
    Metric("teacher_parameter_bytes", "teacher params", "bytes", merge="max", lower_is_better=None),
    # kernels (``scripts/bench_kernels.py``): ours against a baseline implementation, both in every iteration
    _ms("kernel_ms", "ours", compared=True),
    _ms("baseline_ms", "baseline"),
    Metric("speedup", "speed-up", "ratio", merge="mean", lower_is_better=False, compared=True),
    _ms("greedy_ms", "greedy"),
    _ms("call_ms", "ours call"),
    _ms("baseline_call_ms", "baseline call"),
    Metric("baseline_peak_memory_bytes", "baseline peak", "bytes"),
    Metric("baseline_kv_workspace_bytes", "baseline KV", "bytes"),
]}

ATTRIBUTED_PHASES = ("param_gather", "inference_cache", "lora_fuse", "lora_unfuse", "gc", "empty_cache",
                     "workspace_alloc", "compaction", "compile", "weight_layout", "scheduler", "kv_placement")
"""The attributed phases a rollout profile reports, each as ``<phase>_ms``."""
ROLLOUT_STAGES = ("prompt_expansion_ms", "prefill_ms", "decode_ms", *(f"{p}_ms" for p in ATTRIBUTED_PHASES),
                  "generation_overhead_ms", "post_processing_ms")
"""A rollout's time, broken down: disjoint parts that add up to (at most) ``total_ms``."""
STEP_PARTS = ("rollout", "teacher", "student_forward", "loss", "backward", "optimizer")
"""The parts of an OPSD step, in the order they run."""
STEP_STAGES = ("eval_ms", "rollout_ms", "train_ms", "teacher_forward_ms", "cache_write_ms", "teacher_wait_ms",
               "student_forward_ms", "loss_ms", "backward_ms", "optimizer_ms")
"""An OPSD step's time, broken down: disjoint parts that add up to (at most) its ``total_ms``."""


def hidden_share(wait_ms: float, latency_ms: float) -> float | None:
    """The share of a served teacher's latency hidden behind other work, ``1 - wait / latency`` in [0, 1];
    ``None`` when no request was in flight (an in-process teacher)."""
    if latency_ms <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - wait_ms / latency_ms))


DEEPSPEED_ALIASES: dict[str, str] = {
    "prefill_forward_ms": "prefill_ms",
    "decode_forward_ms": "decode_ms",
    "num_decode_forwards": "decode_steps",
    "num_generated_tokens": "generated_tokens",
    "num_samples_per_prompt": "samples_per_prompt",
    "num_prefill_forwards": "prefill_forwards",
    "scheduler_overhead_ms": "scheduler_ms",
    "cache_management_overhead_ms": "cache_management_ms",
    "active_batch_size": "peak_active_rows",
    "continuous_batch_size": "decode_slots",
}
"""DeepSpeed's profile keys -> ours (a profile answers to both; records carry both)."""

ROLLOUT_PREFIX = "rollout/"
"""A step's flat record names its rollout's figures ``rollout/<key>``."""


# ---- the training record: ``metrics.jsonl`` and DeepSpeed's monitors ------------------------------------------------

TIME = "time/"
"""The training record's namespace (and the monitors') for every time: the step's, its parts', the rollout's
stages', the evaluation's."""
RECORD_ROLLOUT_STAGES = ("prompt_expansion_ms", "prefill_ms", "decode_ms", "post_processing_ms", "param_gather_ms",
                         "inference_cache_ms", "compile_ms", "compaction_ms")
"""The rollout profile's stages a training record carries (``time/rollout/<stage>``), summed over its
micro-batches."""


def _timed(name: str, meaning: str) -> Metric:
    """A step profile's time as the training record names it, ``time/<name>``: the figure of ``METRICS``."""
    figure = METRICS[name.removeprefix(ROLLOUT_PREFIX)]
    return replace(figure, name=TIME + name, monitor=TIME + name, meaning=meaning, compared=False)


_STEP_PART_MEANINGS = {
    "total_ms": "the micro-batches' profiled steps, summed; the `time/` parts below add up to at most this",
    "eval_ms": "`engine.eval()` before each rollout (the mode switch; the held-out evaluation is "
               "`time/evaluation_ms`)",
    "rollout_ms": "the rollout calls",
    "train_ms": "`engine.train()` after each rollout (the mode switch)",
    "teacher_forward_ms": "the teacher's forwards and LM-head chunks",
    "cache_write_ms": "copying the teacher's logits (or their top-k) to the host cache",
    "teacher_wait_ms": "waiting for a served teacher's answer, after the student's forward: its latency not hidden",
    "student_forward_ms": "the student's forwards",
    "loss_ms": "the divergence (with the fused loss, the LM head and its gradients too)",
    "backward_ms": "the backward passes",
    "optimizer_ms": "`engine.step()` (the optimizer at the accumulation boundary; the gradient norm at ZeRO-0)",
}

TEACHER_FIGURE = Metric("teacher_eval", "teacher", "ratio", merge="mean", lower_is_better=None)
"""What the teacher's task figures share: a reference the student is read against, not a figure to improve."""

TRAINING: dict[str, Metric] = {m.name: m for m in [
    Metric("step", "step", "count", lower_is_better=None,
           meaning="the optimizer step (0: the evaluation before any update); every monitor event's step"),
    Metric("epoch", "epoch", "epochs", merge="mean", lower_is_better=None, monitor="train/epoch",
           meaning="the training prompts drawn so far (every rank's) over the training set's, as HF Trainer counts"),
    METRICS["loss"],
    Metric("loss/NAME", "loss NAME", "loss", merge="mean", lower_is_better=None, monitor="train/loss/NAME",
           meaning="with several teachers, the loss over the response tokens routed to teacher NAME (one key a "
                   "teacher: `loss/math`)"),
    Metric("grad_norm", "grad norm", "", merge="mean", lower_is_better=None, monitor="train/grad_norm",
           meaning="the 2-norm of the gradient the optimizer stepped on, before clipping (DeepSpeed's at ZeRO 1-3; "
                   "taken before the step at ZeRO-0)"),
    Metric("learning_rate", "lr", "", merge="mean", lower_is_better=None, monitor="train/learning_rate",
           meaning="the optimizer's learning rate after the step (DeepSpeed's `get_lr()`, the first group's)"),
    Metric("skipped_steps", "skipped", "count", merge="mean", monitor="train/skipped_steps",
           meaning="optimizer steps skipped so far for a non-finite loss or gradient, no weight moved (DeepSpeed's "
                   "`skipped_steps`, kept by its checkpoints; an fp16 loss scaler's overflows count too)"),
    Metric("nonfinite", "non-finite", "text", lower_is_better=None,
           meaning="on a skipped step, what went non-finite first on any rank: `teacher cache`, `student forward`, "
                   "`loss` or `gradient` (the step's `loss` and `grad_norm` are then `null`)"),
    Metric("divergence", "divergence", "text", lower_is_better=None,
           meaning="the loss: `jsd`, `forward_kl`, `reverse_kl`, `sampled_reverse_kl`, or `cross_entropy` (SFT)"),
    Metric("teacher", "teacher", "text", lower_is_better=None,
           meaning="who scored the step: the teacher's preset, directory or address, `self (initial)` or `self (live)` "
                   "for the student as its own teacher; with several, `NAME=...` each; `null` for SFT"),
    Metric("teacher_context", "context", "text", lower_is_better=None,
           meaning="the context the teacher was shown before the student's response (`--teacher-context`: its "
                   "template, `{prompt}` and `{reference}` filled per example); `null`: the student's own prompt"),
    Metric("on_policy", "on-policy", "bool", lower_is_better=None,
           meaning="whether the step trained on the student's own samples (`--lmbda`'s draw); `null` for SFT"),
    Metric("trainable_parameters", "trainable", "count", lower_is_better=None,
           meaning="the parameters the optimizer updates (a LoRA student's: its adapters'), in step 0's record"),
    Metric("micro_batches", "micro-batches", "count", lower_is_better=None, monitor="train/micro_batches",
           meaning="micro-batches of the step (each rank's): DeepSpeed's `gradient_accumulation_steps`"),
    METRICS["response_tokens"],
    METRICS["tokens_per_second"],
    Metric("time/step_ms", "step", "ms", monitor="time/step_ms",
           meaning="the optimizer step's wall time (its micro-batches with their data and seeding)"),
    Metric("time/steps_s", "steps", "s", lower_is_better=None, monitor="time/steps_s",
           meaning="the optimizer steps' wall time so far, evaluations apart (`time/step_ms` summed, continued "
                   "by `--resume`)"),
    *(_timed(name, _STEP_PART_MEANINGS[name]) for name in ("total_ms", *STEP_STAGES)),
    replace(METRICS["teacher_latency_ms"], name="time/teacher_latency_ms", monitor="time/teacher_latency_ms",
            compared=False, meaning="a served teacher's requests, sending to the cache written, summed: in flight "
                                    "behind the student's forwards (and, with accumulation, the next micro-batches' "
                                    "rollouts), so not a part of `time/total_ms`"),
    replace(METRICS["teacher_hidden_share"], name="time/teacher_hidden_share", monitor="time/teacher_hidden_share",
            meaning="1 - `time/teacher_wait_ms` / `time/teacher_latency_ms`: the share of the served teacher's "
                    "latency the step's own work hid (with a served teacher)"),
    replace(METRICS["rollout_share"], name="time/rollout_share", monitor="time/rollout_share",
            meaning="(`time/eval_ms` + `time/rollout_ms` + `time/train_ms`) / `time/total_ms`"),
    *(_timed(ROLLOUT_PREFIX + stage, f"the rollout profile's `{stage}`, summed (when a rollout ran it)")
      for stage in RECORD_ROLLOUT_STAGES),
    METRICS["peak_memory_bytes"],
    METRICS["teacher_cache_bytes"],
    Metric("rss_bytes", "RSS", "bytes", monitor="train/rss_bytes",
           meaning="the process's resident memory after the step: flat over a run, or a leak"),
    Metric("eval_reverse_kl", "reverse KL", "nats/token", merge="mean", monitor="eval/reverse_kl",
           meaning="held-out reverse KL, student to teacher, on the student's samples, exact over the "
                   "vocabulary (a served teacher's: the unbiased k3 estimate from the sampled tokens)"),
    Metric("eval_reverse_kl/NAME", "reverse KL NAME", "nats/token", merge="mean", monitor="eval/reverse_kl/NAME",
           meaning="with several teachers, `eval_reverse_kl` over the held-out examples routed to teacher NAME "
                   "(one key a teacher: `eval_reverse_kl/math`)"),
    Metric("eval_cross_entropy", "cross-entropy", "nats/token", merge="mean", monitor="eval/cross_entropy",
           meaning="held-out cross-entropy of the student on the references (when the data has them)"),
    Metric("eval_accuracy", "accuracy", "ratio", merge="mean", lower_is_better=False, monitor="eval/accuracy",
           meaning="task evaluation (`--eval-data`): the fraction of problems the student's greedy completion "
                   "answers right, by `--eval-scorer`"),
    Metric("eval_unextractable", "unextractable", "count", merge="mean", monitor="eval/unextractable",
           meaning="task evaluation: greedy completions with no answer the scorer can read (counted wrong)"),
    Metric("eval_pass@1", "pass@1", "ratio", merge="mean", lower_is_better=False, monitor="eval/pass@1",
           meaning="task evaluation with `--eval-samples` K > 1: pass@1 averaged over K samples a problem (the "
                   "mean of c/K)"),
    Metric("eval_pass@K", "pass@K", "ratio", merge="mean", lower_is_better=False, monitor="eval/pass@K",
           meaning="task evaluation with K > 1: the unbiased pass@K (Chen et al. 2021), K the number in the key "
                   "(`eval_pass@8`) and the monitor name (`eval/pass@8`)"),
    *(replace(TEACHER_FIGURE, name=f"teacher_eval_{name}", label=f"teacher {name}", monitor=f"eval/teacher_{name}",
              unit="count" if name == "unextractable" else "ratio",
              meaning=f"the teacher's `eval_{name}`, scored once, in the step-0 record (an in-process teacher's; "
                      "a served teacher is not scored)")
      for name in ("accuracy", "unextractable", "pass@1", "pass@K")),
    Metric("time/evaluation_ms", "evaluation", "ms", monitor="time/evaluation_ms",
           meaning="the evaluation's wall time (on evaluation steps): held-out, task, and the teacher's task "
                   "evaluation at step 0"),
    Metric("time/task_evaluation_ms", "task evaluation", "ms", monitor="time/task_evaluation_ms",
           meaning="the student's task evaluation's wall time (part of `time/evaluation_ms`)"),
]}
"""Every key a training run's record may hold (``metrics.jsonl``), in the order a record holds them, with its name
in DeepSpeed's monitors; docs/TRAINING.md's table of the keys is made from it."""

TEACHER_SUFFIX = "/NAME"
"""A key registered with ``/NAME`` (``loss/NAME``) stands for every teacher's (``loss/math``)."""
K_SUFFIX = "@K"
"""A key registered with ``@K`` (``eval_pass@K``) stands for every ``@<number>`` key (``eval_pass@8``)."""


def training_metric(key: str) -> Metric | None:
    """The registry's entry for a training record's key, ``None`` for a key it lacks. A key whose number
    depends on the run (``eval_pass@8``, K = ``--eval-samples``) is its ``@K`` entry under its own name and
    monitor name (``eval/pass@8``); a teacher's (``loss/math``, with several teachers) its ``/NAME`` entry
    (``train/loss/math``)."""
    if key in TRAINING:
        return TRAINING[key]
    stem, slash, teacher = key.rpartition("/")
    template = TRAINING.get(stem + TEACHER_SUFFIX) if slash and teacher else None
    if template is not None:
        named = {field: getattr(template, field).removesuffix("NAME") + teacher
                 for field in ("label", "monitor") if getattr(template, field)}
        return replace(template, name=key, **named)
    stem, at, number = key.rpartition("@")
    template = TRAINING.get(stem + K_SUFFIX) if at and number.isdigit() else None
    if template is None:
        return None
    numbered = {field: getattr(template, field).removesuffix(K_SUFFIX) + "@" + number
                for field in ("label", "monitor") if getattr(template, field)}
    return replace(template, name=key, **numbered)


def metric(name: str) -> Metric:
    """The registered metric (also under DeepSpeed's name, or a step record's ``rollout/`` name, so ranks merge
    every spelling of a figure by its rule; or a training record's key), or a default one for an unregistered
    field (a time if it ends in ``_ms``)."""
    own = DEEPSPEED_ALIASES.get(name.removeprefix(ROLLOUT_PREFIX), name.removeprefix(ROLLOUT_PREFIX))
    if name in METRICS:
        return METRICS[name]
    if own in METRICS:
        return METRICS[own]
    if training_metric(name) is not None:
        return training_metric(name)
    unit = "ms" if name.endswith("_ms") else ("bytes" if name.endswith("_bytes") else "")
    return Metric(name, name.removesuffix("_ms"), unit, lower_is_better=True if unit else None)


def label(name: str) -> str:
    return metric(name).label


BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
"""The units a size in bytes is written in and read from, largest first."""


def bytes_text(count: int | float | None) -> str:
    """``count`` bytes for a person, rounded: in the largest unit that keeps it at 1 or more, one decimal (``1.5
    GiB``, ``20.2 KiB``), ``512 bytes`` below a KiB, ``n/a`` for ``None``. For messages and summaries; a table's
    memory column is in MiB (``bench.tables.mib``)."""
    if count is None:
        return "n/a"
    for unit, size in BYTE_UNITS:
        if count >= size:
            return f"{count / size:,.1f} {unit}"
    return f"{count:g} bytes"


def size_text(count: int) -> str:
    """``count`` bytes exactly, as a flag or a result's config key spells it and ``parse_size`` reads it back: in
    the largest unit that divides it (``8388608`` -> ``8MiB``), else the number of bytes."""
    for unit, size in BYTE_UNITS:
        if count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


def parse_size(value: object) -> int:
    """Bytes from a size a flag or a file gives: a number of bytes, or a number with KiB, MiB, GiB or TiB (``8GiB``,
    ``1.5GiB``; any case); ``ValueError`` for anything else or under 1 byte."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be bytes or a number with a unit; got {value!r}")
    text = str(value).strip().lower()
    number = text.rstrip("kmgtib")
    units = {"": 1, "b": 1, **{unit.lower(): size for unit, size in BYTE_UNITS}}
    try:
        size = int(float(number) * units[text[len(number):]])
    except (KeyError, ValueError, OverflowError):
        raise ValueError(f"a size must be bytes or a number with KiB, MiB, GiB or TiB; got {value!r}") from None
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte; got {value!r}")
    return size
