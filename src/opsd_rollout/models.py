"""Models by name: a built-in preset (``opsd_rollout.presets``, with a byte-level tokenizer built in code: a real
transformers fast tokenizer, so it saves and reloads like any other) or a local checkpoint directory. Nothing
here ever downloads.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from opsd_rollout.modeling import max_positions_of
from opsd_rollout.presets import (BOS_ID, BOS_TOKEN, BYTE_OFFSET, DEFAULT_MODEL, EOS_ID, EOS_TOKEN, PAD_ID,
                                  PAD_TOKEN, PRESETS, VOCAB_SIZE, ModelPreset)

__all__ = ["BOS_ID", "DEFAULT_MODEL", "EOS_ID", "PAD_ID", "PRESETS", "VOCAB_SIZE", "ModelPreset", "byte_tokenizer",
           "dtype_name", "load_model", "max_positions", "model_config", "parse_dtype"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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


def _byte_tokenizer_object():
    vocab = {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    vocab.update({char: BYTE_OFFSET + byte for byte, char in _byte_alphabet().items()})
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_tokenizer():
    """A transformers fast tokenizer over bytes: pad 0, bos 1, eos 2, byte b is b + 3; pads on the left."""
    return PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer_object(), pad_token=PAD_TOKEN,
                                   bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, padding_side="left")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``fp32``/``fp16``/``bf16`` (or a ``torch.dtype``) to a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}; got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))


def load_model(name_or_path: str, *, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu"):
    """Return ``(model, tokenizer)`` for a preset name or a local checkpoint directory.

    Hub ids are refused: this tool never downloads. Download the checkpoint yourself and pass its path.
    """
    torch_dtype = parse_dtype(dtype)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path].build(dtype=torch_dtype, device=device), byte_tokenizer()
    if os.path.isdir(name_or_path):
        return _load_local(name_or_path, torch_dtype, device)
    raise ValueError(
        f"model {name_or_path!r} is neither a built-in preset ({', '.join(PRESETS)}) nor a local directory. "
        "opsd-rollout never downloads weights: download the checkpoint yourself "
        "(e.g. `huggingface-cli download <id> --local-dir DIR`) and pass the local path.")


def model_config(name_or_path: str):
    """The model's transformers config alone (no weights), for a preset or a local checkpoint directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path].make_config()
    if os.path.isdir(name_or_path):
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    load_model(name_or_path)  # raises the "never downloads" error
    raise AssertionError("unreachable")


def max_positions(name_or_path: str) -> int | None:
    """The model's position limit, from its config alone (no weights); ``None`` when it has none."""
    return max_positions_of(model_config(name_or_path))


def _load_local(path: str, dtype: torch.dtype, device: str | torch.device):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # rollouts take left-padded prompts
    return model.to(device).eval(), tokenizer
