"""The built-in model presets: real transformers architectures (Llama, Qwen2, GPT-2) at named sizes, with random
weights drawn from a fixed seed (or one given to ``build``); ``tiny`` presets run in milliseconds for tests,
``small`` ones have tens of millions of parameters for benchmarks, and the realistic ones (``qwen2-0.5b``,
``llama-1b``) have the shapes and vocabularies of real small models, to show what a real vocabulary does to
sampling, the LM head and the loss.
Nothing here downloads. Every preset's tokenizer is the byte tokenizer: its 259 ids are valid in every preset,
and the realistic presets' other ids are tokens the model can sample (without text).

A light module (no torch or transformers at import: the command line reads it for its help); a preset imports
them when it builds its model. ``opsd_rollout.models`` loads presets and local checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.modeling_utils import PreTrainedModel

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # byte b has id b + BYTE_OFFSET
VOCAB_SIZE = BYTE_OFFSET + 256
DEFAULT_MODEL = "llama-small"
PRESET_SEED = 1234


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A named architecture and size; ``build()`` makes the model, with the same weights for the same seed."""

    name: str
    """``<arch>-<size>``, e.g. ``llama-tiny``."""
    arch: str
    """transformers model type: ``llama``, ``qwen2`` or ``gpt2``."""
    description: str
    """One line for ``opsd-rollout models``."""
    config_kwargs: dict[str, Any]
    """Keyword arguments of the architecture's config class."""

    @property
    def vocab_size(self) -> int:
        return self.config_kwargs.get("vocab_size", VOCAB_SIZE)

    def make_config(self) -> PreTrainedConfig:
        from transformers import AutoConfig  # heavy: see the module docstring

        common = dict(vocab_size=VOCAB_SIZE, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        return AutoConfig.for_model(self.arch, **{**common, **self.config_kwargs})

    @property
    def max_positions(self) -> int | None:
        """The position limit, from the config numbers (no transformers import: a dry run reads it)."""
        kwargs = self.config_kwargs
        return kwargs.get("max_position_embeddings") or kwargs.get("n_positions")

    def num_parameters(self) -> int:
        """Counted from the config numbers, so ``opsd-rollout models`` lists sizes without importing torch or
        transformers; an architecture without a formula here is built on the meta device and counted."""
        count = _COUNTS[self.arch](self.config_kwargs, self.vocab_size) if self.arch in _COUNTS else None
        if count is None:
            count = sum(p.numel() for p in self.build(device="meta").parameters())
        return count

    def build(self, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
              seed: int | None = None) -> PreTrainedModel:
        """Instantiate in eval mode with weights drawn from ``seed`` (global RNG state untouched); ``dtype``
        defaults to float32.

        ``seed=None`` is ``PRESET_SEED``, so every result measured on a preset keeps its weights. Another seed gives
        the same architecture other weights: a teacher of the student's preset that is not the student itself
        (with equal weights the distillation loss is 0)."""
        import torch  # heavy: see the module docstring
        from transformers import AutoModelForCausalLM

        dtype = dtype or torch.float32
        seed = PRESET_SEED if seed is None else _seed(seed)
        config = self.make_config()
        if torch.device(device).type == "meta":
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model.to(device=device, dtype=dtype).eval()


def _seed(seed: object) -> int:
    """``seed`` checked: an int, as ``torch.manual_seed`` takes it (a float or a bool would be taken silently)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int (or None for the preset's own weights); got {seed!r}")
    return seed


def _llama_parameters(c: dict[str, Any], vocab: int, *, qkv_bias: bool = False) -> int:
    """LlamaForCausalLM's (and Qwen2's, with ``qkv_bias``) parameter count from its config numbers: embedding,
    per layer attention (q, k, v, o), gated MLP and two RMSNorms, the final norm, and an untied LM head."""
    hidden, heads, ffn = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    kv_heads = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + ((q + 2 * kv) if qkv_bias else 0)
    layer = attention + 3 * hidden * ffn + 2 * hidden
    head = 0 if c.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + c["num_hidden_layers"] * layer + hidden + head


def _gpt2_parameters(c: dict[str, Any], vocab: int) -> int:
    """GPT2LMHeadModel's parameter count: token and position embeddings, per block two LayerNorms, the fused
    qkv and output projections and the MLP (all with biases), the final LayerNorm; the LM head is tied."""
    hidden, inner = c["n_embd"], c.get("n_inner") or 4 * c["n_embd"]
    block = 2 * 2 * hidden + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) + (
        hidden * inner + inner) + (inner * hidden + hidden)
    head = 0 if c.get("tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + c["n_positions"] * hidden + c["n_layer"] * block + 2 * hidden + head


_COUNTS = {"llama": _llama_parameters, "qwen2": lambda c, vocab: _llama_parameters(c, vocab, qkv_bias=True),
           "gpt2": _gpt2_parameters}
"""Parameter-count formulas by architecture (checked against the models built on the meta device in the tests)."""


def _llama_like(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, positions: int) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=ffn, max_position_embeddings=positions,
                tie_word_embeddings=False)


def _gpt2(hidden: int, layers: int, heads: int, positions: int) -> dict[str, Any]:
    return dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


QWEN25_05B = dict(_llama_like(896, 24, 14, 2, 4864, 32768), vocab_size=151936, tie_word_embeddings=True,
                  rope_theta=1e6, rms_norm_eps=1e-6)
"""Qwen2.5-0.5B's shapes (its config.json): 494,032,768 parameters, 136 million of them the tied embedding."""
LLAMA32_1B = dict(_llama_like(2048, 16, 32, 8, 8192, 131072), vocab_size=128256, tie_word_embeddings=True,
                  head_dim=64, rms_norm_eps=1e-5, rope_theta=5e5,
                  rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192))
"""Llama-3.2-1B's shapes (its config.json): 1,235,814,400 parameters, 263 million of them the tied embedding."""

PRESETS: dict[str, ModelPreset] = {
    p.name: p for p in [
        ModelPreset(name="llama-tiny", arch="llama", description="Llama, 2 layers, d=64 (tests)",
                    config_kwargs=_llama_like(64, 2, 4, 2, 128, 1024)),
        ModelPreset(name="llama-micro", arch="llama", description="Llama, 2 layers, d=128, GQA 4/2 (the built-in "
                    "arithmetic task's teacher)", config_kwargs=_llama_like(128, 2, 4, 2, 352, 1024)),
        ModelPreset(name="llama-mini", arch="llama", description="Llama, 4 layers, d=256, GQA 4/2 (the built-in "
                    "training run's teacher)", config_kwargs=_llama_like(256, 4, 4, 2, 704, 1024)),
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
        ModelPreset(name="qwen2-0.5b", arch="qwen2", description="Qwen2.5-0.5B's shapes: 24 layers, d=896, GQA 14/2, "
                    "V=151,936, tied embeddings (realistic)", config_kwargs=QWEN25_05B),
        ModelPreset(name="llama-1b", arch="llama", description="Llama-3.2-1B's shapes: 16 layers, d=2048, GQA 32/8, "
                    "V=128,256, tied embeddings (realistic)", config_kwargs=LLAMA32_1B),
    ]
}
