"""Models by name: a built-in preset (``opsd_rollout.presets``, with a byte-level tokenizer built in code: a real
transformers fast tokenizer, so it saves and reloads like any other) or a local checkpoint directory, a PEFT adapter
directory too (a LoRA run's ``model/``: its base with the adapters merged in). Nothing here ever downloads.

Light at import (torch, tokenizers and transformers load inside the functions that build something): the
command line's dry run reads ``max_positions`` from here without paying for them.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from opsd_rollout.presets import (BOS_ID, BOS_TOKEN, BYTE_OFFSET, DEFAULT_MODEL, EOS_ID, EOS_TOKEN, PAD_ID,
                                  PAD_TOKEN, PRESETS, VOCAB_SIZE, ModelPreset)

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.modeling_utils import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

__all__ = ["ADAPTER_CONFIG", "BOS_ID", "DEFAULT_MODEL", "EOS_ID", "PAD_ID", "PRESETS", "VOCAB_SIZE", "ModelPreset",
           "adapter_base", "byte_tokenizer", "dtype_name", "load_model", "load_tokenizer", "max_positions",
           "model_config", "model_skeleton", "parse_dtype", "vocab_size"]


def _dtypes() -> dict[str, torch.dtype]:
    """The dtype names the command line and configs accept (a function: torch loads on first use)."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _byte_alphabet() -> dict[int, str]:
    """The printable stand-in for each byte used by byte-level BPE (GPT-2's convention)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def _byte_tokenizer_object() -> Tokenizer:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    vocab.update({char: BYTE_OFFSET + byte for byte, char in _byte_alphabet().items()})
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A transformers fast tokenizer over bytes: pad 0, bos 1, eos 2, byte b is b + 3; pads on the left."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer_object(), pad_token=PAD_TOKEN,
                                   bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, padding_side="left")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``fp32``/``fp16``/``bf16`` (or a ``torch.dtype``) to a ``torch.dtype``."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    dtypes = _dtypes()
    try:
        return dtypes[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}; got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _dtypes().items()}.get(dtype, str(dtype).removeprefix("torch."))


def load_model(name_or_path: str, *, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu",
               seed: int | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` for a preset name or a local checkpoint directory.

    ``seed``: a preset's weights are drawn from it (``None``: the preset's own seed, the weights every result
    here was measured with); a teacher built from the student's preset needs another one, or it is the student
    and the distillation loss is 0. A checkpoint has its weights already, so a seed for one is refused.
    Hub ids are refused: this tool never downloads. Download the checkpoint yourself and pass its path.
    """
    torch_dtype = parse_dtype(dtype)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path].build(dtype=torch_dtype, device=device, seed=seed), byte_tokenizer()
    if os.path.isdir(name_or_path):
        if seed is not None:
            raise ValueError(f"seed={seed!r} draws a built-in preset's weights, and {name_or_path!r} is a checkpoint "
                             "directory, which keeps its own: drop the seed, or name a preset")
        base = adapter_base(name_or_path)
        if base is not None:  # a LoRA student's model/: its base with the adapters merged in
            import warnings

            from peft import PeftModel

            model, tokenizer = load_model(base, dtype=dtype, device=device)
            with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                merged = PeftModel.from_pretrained(model, name_or_path).merge_and_unload()
            return merged.eval(), load_tokenizer(name_or_path) or tokenizer
        return _load_local(name_or_path, torch_dtype, device)
    raise _refuse(name_or_path)


ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter directory holds this (and the adapter weights) instead of a model's ``config.json``."""


def adapter_base(path: str) -> str | None:
    """The base model (a preset or a directory) of a PEFT adapter directory (``adapter_config.json``'s
    ``base_model_name_or_path``, as a LoRA run writes it), or ``None`` for anything else."""
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as handle:
            base = json.load(handle).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    if not isinstance(base, str) or not (base in PRESETS or os.path.isdir(base)):
        raise ValueError(f"{path!r} is a PEFT adapter directory whose base model ({base!r} in its {ADAPTER_CONFIG}) "
                         "is neither a built-in preset nor a local directory: set base_model_name_or_path to one")
    return base


def _config_source(name_or_path: str) -> str:
    """Where a model's config is: an adapter directory's base's, else its own."""
    return (adapter_base(name_or_path) or name_or_path) if os.path.isdir(name_or_path) else name_or_path


def _refuse(name_or_path: str) -> ValueError:
    """Neither a preset nor a local directory: the error that says this tool never downloads."""
    return ValueError(
        f"model {name_or_path!r} is neither a built-in preset ({', '.join(PRESETS)}) nor a local directory. "
        "opsd-rollout never downloads weights: download the checkpoint yourself "
        "(e.g. `huggingface-cli download <id> --local-dir DIR`) and pass the local path.")


def model_config(name_or_path: str) -> PreTrainedConfig:
    """The model's transformers config alone (no weights), for a preset or a local checkpoint directory (an adapter
    directory's base's)."""
    name_or_path = _config_source(name_or_path)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path].make_config()
    if os.path.isdir(name_or_path):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    raise _refuse(name_or_path)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer alone (a preset's byte tokenizer, or a checkpoint directory's), set up as ``load_model``'s is;
    ``None`` for a directory that holds none (a model saved without its tokenizer)."""
    if name_or_path in PRESETS:
        return byte_tokenizer()
    if not os.path.isdir(name_or_path):
        raise _refuse(name_or_path)
    from transformers import AutoTokenizer  # heavy: see the module docstring

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError):
        return None
    return _prepared(tokenizer)


def _prepared(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A checkpoint's tokenizer as rollouts take it: padding on the left, EOS as the pad when it has none."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # rollouts take left-padded prompts
    return tokenizer


def model_skeleton(name_or_path: str) -> PreTrainedModel:
    """The model built from its config on the meta device: its modules and shapes, no weights (what a check of its
    layers needs, in a fraction of loading it)."""
    import torch  # heavy: see the module docstring
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(name_or_path))


def max_positions(name_or_path: str) -> int | None:
    """The model's position limit, from its config alone (no weights); ``None`` when it has none. A preset's
    config numbers and a checkpoint's ``config.json`` are read directly (no transformers import: the dry run
    stays quick); transformers reads the config only when they do not name the limit."""
    name_or_path = _config_source(name_or_path)
    if name_or_path in PRESETS:
        limit = PRESETS[name_or_path].max_positions
    elif os.path.isdir(name_or_path):
        limit = _positions_in_config_file(os.path.join(name_or_path, "config.json"))
    else:
        raise _refuse(name_or_path)
    if limit is not None:
        return limit
    from opsd_rollout.modeling import max_positions_of  # heavy: see the module docstring

    return max_positions_of(model_config(name_or_path))


def vocab_size(name_or_path: str) -> int | None:
    """The model's vocabulary size, from its config alone and without transformers (a preset's number, a
    checkpoint's ``config.json``, its text config's for a multimodal model); ``None`` when the file does not say
    (transformers' config then tells, once loaded). A name that is neither a preset nor a directory is refused."""
    name_or_path = _config_source(name_or_path)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path].vocab_size
    if os.path.isdir(name_or_path):
        size = _text_config_file(os.path.join(name_or_path, "config.json")).get("vocab_size")
        return size if isinstance(size, int) else None
    raise _refuse(name_or_path)


def _positions_in_config_file(path: str) -> int | None:
    """``max_position_embeddings`` (or GPT-2's ``n_positions``) of a checkpoint's ``config.json``, its text
    config's for a multimodal model, as ``modeling.max_positions_of`` reads it; ``None`` when absent or unreadable."""
    config = _text_config_file(path)
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    return limit if isinstance(limit, int) else None


def _text_config_file(path: str) -> dict:
    """A checkpoint's ``config.json`` as a dict, its ``text_config`` for a multimodal model; empty when absent or
    unreadable."""
    try:
        with open(path) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _load_local(path: str, dtype: torch.dtype,
                device: str | torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = _prepared(AutoTokenizer.from_pretrained(path, local_files_only=True))
    return model.to(device).eval(), tokenizer
