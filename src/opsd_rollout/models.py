"""Built-in model presets and local checkpoint loading. Nothing here ever downloads.

A preset is a real transformers architecture (Llama, Qwen2, GPT-2) with random weights drawn from a
fixed seed, paired with a byte-level tokenizer built in code (a real transformers fast tokenizer, so it
saves and reloads like any other). ``tiny`` presets run in milliseconds for tests; ``small`` presets
have tens of millions of parameters for benchmarks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # byte b has id b + BYTE_OFFSET
VOCAB_SIZE = BYTE_OFFSET + 256
DEFAULT_MODEL = "llama-small"
PRESET_SEED = 1234

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A named architecture and size; ``build()`` makes the model, always with the same weights."""

    name: str
    """``<arch>-<size>``, e.g. ``llama-tiny``."""
    arch: str
    """transformers model type: ``llama``, ``qwen2`` or ``gpt2``."""
    description: str
    """One line for ``opsd-rollout models``."""
    config_kwargs: dict[str, Any]
    """Keyword arguments of the architecture's config class."""

    def make_config(self):
        from transformers import AutoConfig

        common = dict(vocab_size=VOCAB_SIZE, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        return AutoConfig.for_model(self.arch, **common, **self.config_kwargs)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.build(device="meta").parameters())

    def build(self, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """Instantiate in eval mode with weights from ``PRESET_SEED`` (global RNG state untouched)."""
        from transformers import AutoModelForCausalLM

        config = self.make_config()
        if torch.device(device).type == "meta":
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(PRESET_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model.to(device=device, dtype=dtype).eval()


def _llama_like(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, positions: int) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=ffn, max_position_embeddings=positions,
                tie_word_embeddings=False)


def _gpt2(hidden: int, layers: int, heads: int, positions: int) -> dict[str, Any]:
    return dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


PRESETS: dict[str, ModelPreset] = {
    p.name: p for p in [
        ModelPreset(name="llama-tiny", arch="llama", description="Llama, 2 layers, d=64 (tests)",
                    config_kwargs=_llama_like(64, 2, 4, 2, 128, 1024)),
        ModelPreset(name="llama-small", arch="llama", description="Llama, 8 layers, d=512, GQA 8/4 (bench)",
                    config_kwargs=_llama_like(512, 8, 8, 4, 1408, 2048)),
        ModelPreset(name="qwen2-tiny", arch="qwen2", description="Qwen2, 2 layers, d=64, qkv bias (tests)",
                    config_kwargs=_llama_like(64, 2, 4, 2, 128, 1024)),
        ModelPreset(name="qwen2-small", arch="qwen2", description="Qwen2, 8 layers, d=512, GQA 8/4 (bench)",
                    config_kwargs=_llama_like(512, 8, 8, 4, 1408, 2048)),
        ModelPreset(name="gpt2-tiny", arch="gpt2", description="GPT-2, 2 layers, d=64, learned positions (tests)",
                    config_kwargs=_gpt2(64, 2, 4, 1024)),
        ModelPreset(name="gpt2-small", arch="gpt2", description="GPT-2, 8 layers, d=512 (bench)",
                    config_kwargs=_gpt2(512, 8, 8, 1024)),
    ]
}


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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    vocab.update({char: BYTE_OFFSET + byte for byte, char in _byte_alphabet().items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_tokenizer():
    """A transformers fast tokenizer over bytes: pad 0, bos 1, eos 2, byte b is b + 3; pads on the left."""
    from transformers import PreTrainedTokenizerFast

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


def max_positions(name_or_path: str) -> int | None:
    """The model's position limit, from its config alone (no weights); ``None`` when it has none."""
    if name_or_path in PRESETS:
        config = PRESETS[name_or_path].make_config()
    elif os.path.isdir(name_or_path):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    else:
        load_model(name_or_path)  # raises the "never downloads" error
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _load_local(path: str, dtype: torch.dtype, device: str | torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # rollouts take left-padded prompts
    return model.to(device).eval(), tokenizer


def model_choices() -> list[tuple[str, str]]:
    """``(name, description)`` of every preset, for the CLI."""
    return [(p.name, p.description) for p in PRESETS.values()]

