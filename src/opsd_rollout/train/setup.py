"""What a training run checks and builds before its first step: the models (vocabularies and positions checked),
the examples and their held-out split, and the student's DeepSpeed engine from the user's config or one built."""

from __future__ import annotations

import argparse
import copy
import os
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from opsd_rollout.deepspeed_config import check_deepspeed_config, read_deepspeed_file, refusal
from opsd_rollout.modeling import max_positions_of, text_config
from opsd_rollout.models import load_model, load_tokenizer, model_config, model_skeleton, parse_dtype
from opsd_rollout.opsd.self_teacher import SelfTeacher
from opsd_rollout.opsd.served import ServedTeacher
from opsd_rollout.opsd.served_wire import KeyRefused
from opsd_rollout.presets import PRESETS
from opsd_rollout.train.data import Example
from opsd_rollout.train.lora import check_targets, with_adapters
from opsd_rollout.train.optimization import OptimizationConfig
from opsd_rollout.train.precision import device_index, run_device_type, run_dtype, with_dtype
from opsd_rollout.train.preflight import check_vocabularies
from opsd_rollout.train.teacher_spec import KEY_VARIABLE, SELF, UNNAMED, TeacherSpec

if TYPE_CHECKING:
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from opsd_rollout.train.config import TrainConfig

HELD_OUT_EVERY = 10
"""A prompt file's every tenth example is held out (files of fewer than ten evaluate on their training prompts)."""


@dataclass
class Models:
    student: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    teacher: torch.nn.Module | ServedTeacher | dict[str, torch.nn.Module | ServedTeacher] | None
    """The one teacher, or several by name when examples are routed (``TrainConfig.several``); ``None``: SFT."""
    max_prompt_tokens: int
    """The longest prompt a rollout can take: the models' positions less ``max_new_tokens`` (or the config's)."""
    max_teacher_prompt_tokens: int = 1 << 30
    """The longest prompt a teacher shown a context can take: the models' positions less ``max_new_tokens``."""

    def check_prompts(self, examples: list[Example], config: TrainConfig) -> None:
        """Refuses, before any work, a prompt longer than ``max_prompt_tokens``."""
        for number, example in enumerate(examples, 1):
            length = len(self.tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
            if length > self.max_prompt_tokens:
                raise ValueError(f"prompt {number} has {length} tokens, over the {self.max_prompt_tokens} a rollout "
                                 f"can take (the models' positions less max_new_tokens {config.sampling.max_new_tokens}, or "
                                 "--max-prompt-tokens): shorten it or lower --max-new-tokens")
            if example.teacher_prompt is None:
                continue
            length = len(self.tokenizer(example.teacher_prompt, add_special_tokens=False)["input_ids"])
            if length > self.max_teacher_prompt_tokens:
                raise ValueError(f"example {number}'s teacher prompt (its context, with the reference) has {length} "
                                 f"tokens, over the {self.max_teacher_prompt_tokens} the models' positions leave after "
                                 f"max_new_tokens {config.sampling.max_new_tokens}: shorten its reference or the "
                                 "--teacher-context, or lower --max-new-tokens")


def load_models(config: TrainConfig) -> Models:
    """Student and tokenizer, and the teachers (each frozen, in eval mode; several by name), once their configs show
    the same vocabulary and positions that fit ``max_prompt_tokens + max_new_tokens``. The user's DeepSpeed config is
    checked first: a run's first model work is here, and a bad config is refused (an unknown key warned of) before."""
    deepspeed_config_of(config)
    local = [spec for spec in config.teachers if spec.kind == "model"]
    configs = [text_config(model_config(name)) for name in (config.student, *(spec.source for spec in local))]
    for spec, theirs in zip(local, configs[1:]):
        check_vocabularies(config.student, configs[0].vocab_size, spec.label, theirs.vocab_size)
    limits = [p for p in (max_positions_of(c) for c in configs) if p]
    positions = min(limits) if limits else 1 << 30
    new_tokens = config.sampling.max_new_tokens
    longest = config.max_prompt_tokens or positions - new_tokens
    if longest < 1 or longest + new_tokens > positions:
        raise ValueError(f"max_prompt_tokens {longest} + max_new_tokens {new_tokens} exceed the models' "
                         f"{positions} positions")
    if config.lora.enabled:  # before the weights load
        check_targets(model_skeleton(config.student), config.lora, config.student)
    dtype = run_precision(config)[1]
    student, tokenizer = load_model(config.student, dtype=dtype)
    if len(tokenizer) > configs[0].vocab_size:  # an id past the embedding would fail mid-rollout, far from here
        raise ValueError(f"student {config.student!r}: its tokenizer has {len(tokenizer):,} tokens and its model a "
                         f"vocabulary of {configs[0].vocab_size:,}: the model's vocab_size must be at least "
                         "len(tokenizer) (added tokens count; docs/MODELS.md)")
    if config.gradient_checkpointing:  # before the adapters: PEFT then sees it (and the LoRA layers recompute too)
        checkpointed(student, config.student)
    if config.lora.enabled:  # fresh adapters on the loaded weights, the base frozen
        student = with_adapters(student, config.lora, config.student, config.seed)
    teachers = {spec.name: load_teacher(spec, config, tokenizer, configs[0].vocab_size, student, dtype)
                for spec in config.teachers}
    teacher = teachers if config.several else next(iter(teachers.values()), None)
    return Models(student, tokenizer, teacher, longest, max_teacher_prompt_tokens=positions - new_tokens)


def checkpointed(student: torch.nn.Module, name: str) -> torch.nn.Module:
    """transformers' gradient checkpointing on ``student`` (``gradient_checkpointing_enable``): in training mode
    each decoder layer keeps its input alone and recomputes the rest in the backward pass, for less memory and
    about a third more compute; a rollout runs in eval mode, uncheckpointed, its cache on. Non-reentrant (torch's
    recommended kind): it needs no input that requires a gradient, so a LoRA student's frozen embeddings need not be
    made to (PEFT's ``enable_input_require_grads``, which the reentrant kind needs), and it works under ZeRO-3."""
    if not getattr(student, "supports_gradient_checkpointing", False):
        raise ValueError(f"--gradient-checkpointing: student {name!r} ({type(student).__name__}) has no gradient "
                         "checkpointing in transformers")
    kwargs = {"use_reentrant": False}
    model: Any = student  # transformers' methods, which nn.Module's attribute types do not know
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24's name; the old one warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return student


def load_teacher(spec: TeacherSpec, config: TrainConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 student: torch.nn.Module, dtype: str = "fp32") -> torch.nn.Module | ServedTeacher:
    """One teacher, checked before any step: a model's tokens against the student's, then its weights in the run's
    ``dtype`` (a preset that is also the student gets other random weights: the same would make the loss 0); a
    server's answer, model, tokenizer and vocabulary (``served_teacher``); the student itself (``SelfTeacher``: its
    starting weights, copied now in its dtype, before any step, or its live ones). Each goes where the student runs
    once its engine is built (``precision.place_teachers``)."""
    if spec.served:
        return served_teacher(spec, tokenizer, vocab_size, student=config.student)
    if spec.kind == "self":
        return SelfTeacher.initial(student) if spec.self_weights == "initial" else SelfTeacher.live(student)
    check_same_tokens(config.student, tokenizer, spec.label, load_tokenizer(spec.source), vocab_size)
    seed = 1 if spec.source == config.student and spec.source in PRESETS else None
    return load_model(spec.source, seed=seed, dtype=dtype)[0].eval().requires_grad_(False)


def check_same_tokens(student: str, tokenizer: PreTrainedTokenizerBase, teacher: str,
                      teacher_tokenizer: PreTrainedTokenizerBase | None,
                      vocab_size: int | None = None) -> None:
    """Refuses a teacher whose tokenizer maps a token to another id than the student's (same vocabulary size,
    other tokens: its logits would score other text), among the ids the models have (``vocab_size``: a token a
    tokenizer adds past the models' vocabulary is one neither can produce or score). A teacher saved without a
    tokenizer is taken as the student's."""
    if teacher_tokenizer is None:
        return
    limit = vocab_size if vocab_size is not None else float("inf")
    ours, theirs = ({token: i for token, i in side.get_vocab().items() if i < limit}
                    for side in (tokenizer, teacher_tokenizer))
    if ours != theirs:
        token = next((t for t in sorted(ours) if theirs.get(t) != ours[t]), None) or next(
            t for t in sorted(theirs) if t not in ours)
        if token not in theirs:
            differs = f"the student's token {ours[token]} ({token!r}) is missing from the teacher's"
        elif token not in ours:
            differs = f"the teacher's token {theirs[token]} ({token!r}) is missing from the student's"
        else:
            differs = f"{token!r} is token {ours[token]} in the student's and token {theirs[token]} in the teacher's"
        raise ValueError(f"the teacher ({teacher}) and the student ({student}) have different tokenizers: {differs}; "
                         "the teacher scores the student's token ids, so both need the same tokens at the same ids "
                         "(save the student's tokenizer with the teacher, or pick a teacher of its family)")


def served_teacher(spec: TeacherSpec, tokenizer: PreTrainedTokenizerBase, vocab_size: int, *,
                   student: str | None = None) -> ServedTeacher:
    """The served teacher of ``spec``, checked before any step: it answers (retried up to its ``timeout``; one
    request's limit ``request_timeout_s``, so a rank gives up within ``wait_bound_s``, the server gone or hung), serves
    ``spec.model`` (when named; a served self-teacher the ``student``'s starting weights), and has the student's
    tokenizer and vocabulary; each failure one line naming both sides."""
    flag = "--teacher-url" if spec.name == UNNAMED else f"--teacher-url {spec.name}="
    teacher = ServedTeacher(spec.source, model=student if spec.model == SELF else spec.model,
                            api_key=spec.api_key or os.environ.get(KEY_VARIABLE),
                            protocol=spec.protocol, tokenizer=tokenizer, retry_timeout_s=spec.timeout,
                            request_timeout_s=spec.request_timeout_s, overlap=overlaps(spec.overlap, spec.source))
    try:
        teacher.connect(vocab_size)
    except ConnectionError as error:
        raise ValueError(f"{flag}: {error}; it is retried for --teacher-timeout, {spec.timeout:g} s") from None
    except KeyRefused as error:
        which = "the key given was not its own" if error.given else "no key was given"
        raise ValueError(f"{flag}: {error.refused}; {which}: set ${KEY_VARIABLE} to the server's --api-key (or "
                         "pass --teacher-api-key, which every user of this machine can read in its process list)") \
            from None
    return teacher


def overlaps(asked: bool | None, url: str) -> bool:
    """Whether a served teacher's requests go in flight behind the student's work: as asked, else on unless the
    server is on loopback and the student on the CPU (both would compute on the same cores: measured slower)."""
    if asked is not None:
        return asked
    host = urllib.parse.urlsplit(url).hostname or ""
    loopback = host == "localhost" or host.startswith("127.") or host == "::1"
    return not (loopback and not torch.cuda.is_available())


def split_examples(config: TrainConfig, examples: list[Example] | None) -> tuple[list[Example], list[Example]]:
    """(train, held-out): a built-in task's own split (``config.task``), or the built-in corpus's when ``examples``
    is ``None``."""
    if config.task is not None:
        from opsd_rollout.train.tasks import task_examples

        return task_examples(config.task, config.task_labelled, config.task_unlabelled)
    if examples is None:
        from opsd_rollout.train.corpus import corpus_examples

        return corpus_examples(reference_chars=config.sampling.max_new_tokens)
    if len(examples) < HELD_OUT_EVERY:
        return examples, examples
    held = set(range(HELD_OUT_EVERY - 1, len(examples), HELD_OUT_EVERY))
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


def deepspeed_config_of(config: TrainConfig, *, check: bool = True) -> dict[str, Any]:
    """The user's DeepSpeed config (``config.optimization.deepspeed``: a JSON file or a dict), checked
    (``check_deepspeed_config``: refused in one line or warned of, unless ``check`` is false), or one built from the
    fields, with what the loop needs filled in where it is absent (micro-batch rows, accumulation, quiet logging)."""
    from opsd_rollout.deepspeed_engine import deepspeed_config

    optimization = config.optimization
    if isinstance(optimization.deepspeed, dict):
        ds = copy.deepcopy(optimization.deepspeed)
    elif optimization.deepspeed is not None:
        ds = read_deepspeed_file(optimization.deepspeed)
    else:
        ds = deepspeed_config(optimization.zero_stage, dtype=parse_dtype(run_precision(config)[1]),
                              lr=optimization.lr)
        ds["gradient_clipping"] = 1.0
        ds["gradient_accumulation_steps"] = optimization.gradient_accumulation_steps
    if optimization.deepspeed is not None:
        if check:
            check_deepspeed_config(ds, _source(optimization))
        with_dtype(ds, run_precision(config, ds)[1])
    rows = config.prompts_per_micro_batch * config.sampling.n_samples_per_prompt
    if "train_batch_size" not in ds:
        ds.setdefault("train_micro_batch_size_per_gpu", rows)
    ds.setdefault("gradient_accumulation_steps", optimization.gradient_accumulation_steps)
    ds.setdefault("steps_per_print", 1 << 30)
    return ds


def run_precision(config: TrainConfig, ds: dict[str, Any] | None = None) -> tuple[str, str]:
    """(device type, dtype name) of the run: ``config.device`` against DeepSpeed's accelerator, ``config.dtype``
    against the user's DeepSpeed config (read from ``config`` unless given as ``ds``; none: the flags build one)."""
    device_type = run_device_type(config.device)
    given = config.optimization.deepspeed
    if ds is None and given is not None:
        ds = copy.deepcopy(given) if isinstance(given, dict) else read_deepspeed_file(given)
    return device_type, run_dtype(config.dtype, ds if given is not None else None, device_type,
                                  _source(config.optimization))


def _source(optimization: OptimizationConfig) -> str:
    """What a message about the DeepSpeed config names: its file, or ``deepspeed config`` for a dict."""
    return "deepspeed config" if isinstance(optimization.deepspeed, dict) else str(optimization.deepspeed)


def build_student_engine(config: TrainConfig, student: torch.nn.Module) -> Any:
    """The student's DeepSpeed engine, in train mode; AdamW at ``config.optimization.lr`` when the DeepSpeed config
    names no optimizer."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfigError
    from pydantic import ValidationError

    from opsd_rollout.deepspeed_engine import init_distributed

    init_distributed(config.group_timeout_s)  # how soon the ranks left stop when one dies
    ds = deepspeed_config_of(config, check=False)  # load_models checked it (and warned once)
    params = [p for p in student.parameters() if p.requires_grad]
    optimization = config.optimization
    optimizer = None if "optimizer" in ds else torch.optim.AdamW(params, lr=optimization.lr)
    try:
        index = device_index(config.device)  # cuda:N: this one process's GPU, not LOCAL_RANK's
        engine, *_ = deepspeed.initialize(args=None if index is None else argparse.Namespace(device_rank=index),
                                          model=student.train(), config=ds, model_parameters=params,
                                          optimizer=optimizer)
    except (AssertionError, KeyError, TypeError, ValidationError, DeepSpeedConfigError) as error:  # its own checks
        source = _source(optimization) if optimization.deepspeed is not None else "the config built from the flags"
        raise ValueError(f"DeepSpeed refused {source}: {refusal(error)}") from None
    engine.train()
    return engine
