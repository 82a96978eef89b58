"""Built-in presets, the byte tokenizer, local checkpoints, and the refusal to download."""

from __future__ import annotations

import pytest
import torch

from opsd_rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from opsd_rollout.models import DEFAULT_MODEL, PRESETS, VOCAB_SIZE, byte_tokenizer, load_model, parse_dtype


def test_presets_cover_every_architecture_and_size():
    assert set(PRESETS) == {f"{a}-{s}" for a in ("llama", "qwen2", "gpt2") for s in ("tiny", "small")} | {
        "qwen2-0.5b", "llama-1b", "llama-mini", "llama-micro"}  # the built-in training runs' teachers
    assert DEFAULT_MODEL == "llama-small"


@pytest.mark.parametrize("name,params,vocab,hidden,layers,kv_heads", [
    ("qwen2-0.5b", 494_032_768, 151_936, 896, 24, 2),      # Qwen2.5-0.5B's config.json and parameter count
    ("llama-1b", 1_235_814_400, 128_256, 2048, 16, 8),     # Llama-3.2-1B's
])
def test_realistic_presets_have_the_real_models_shapes_on_the_meta_device(name, params, vocab, hidden, layers,
                                                                          kv_heads):
    preset = PRESETS[name]
    model = preset.build(device="meta")  # shapes only: nothing allocated
    assert all(p.device.type == "meta" for p in model.parameters())
    assert preset.num_parameters() == params and preset.vocab_size == vocab
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (
        vocab, hidden, layers, kv_heads)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings, as the real models"
    assert tuple(model.lm_head.weight.shape) == (vocab, hidden)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_small_presets_have_tens_of_millions_of_parameters(arch):
    assert 10e6 <= PRESETS[f"{arch}-small"].num_parameters() <= 99e6
    assert PRESETS[f"{arch}-tiny"].num_parameters() < 1e6


def test_preset_weights_are_deterministic_and_leave_global_rng_alone():
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    a = PRESETS["qwen2-tiny"].build()
    assert torch.equal(torch.random.get_rng_state(), before)
    b = PRESETS["qwen2-tiny"].build()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not a.training


def test_byte_tokenizer_round_trips_and_pads_left():
    tok = byte_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok)) == (0, 1, 2, VOCAB_SIZE)
    text = "héllo, wörld ✓"
    ids = tok(text).input_ids
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    batch = tok(["abc", "a"], padding=True, return_tensors="pt")
    assert batch.input_ids[1].tolist() == [0, 0, ord("a") + 3]
    assert batch.attention_mask[1].tolist() == [0, 0, 1]


def test_local_checkpoint_directory_loads_model_and_tokenizer(tmp_path):
    model, tok = load_model("gpt2-tiny")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(str(tmp_path))
    assert loaded_tok.pad_token_id == 0 and loaded_tok.padding_side == "left"
    enc = loaded_tok(["abc"], return_tensors="pt")
    request = RolloutRequest(enc.input_ids, enc.attention_mask)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0)
    assert torch.equal(HybridEngineRollout(loaded, loaded_tok).generate(request, sampling).input_ids,
                       HybridEngineRollout(model, tok).generate(request, sampling).input_ids)


def test_hub_ids_are_refused_with_a_local_path_hint():
    with pytest.raises(ValueError, match="never downloads.*local path"):
        load_model("meta-llama/Llama-3.2-1B")


def test_dtype_names():
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        parse_dtype("fp8")


@pytest.mark.parametrize("name", ["qwen2-0.5b", "llama-small", "gpt2-tiny"])
def test_a_decode_step_reads_every_matrix_once_and_one_row_of_each_lookup_table(name):
    """The roofline's weights (``bench/facts.py``): a tied embedding is the LM head's whole matrix, read once; an
    untied input embedding and GPT-2's learned positions are tables a token reads one row of."""
    from opsd_rollout.bench.facts import decode_weight_bytes
    from opsd_rollout.modeling import ModelSpec

    model = PRESETS[name].build(device="meta")
    spec = ModelSpec.of(model)
    lookups = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    tables = sum(m.weight.numel() for m in lookups if m.weight is not model.get_output_embeddings().weight)
    assert spec.matmul_parameters == spec.parameters - tables
    assert spec.lookup_width == sum(m.embedding_dim for m in lookups)
    if name == "qwen2-0.5b":
        assert tables == 0 and spec.matmul_parameters == 494_032_768 and spec.lookup_width == 896
    else:
        assert tables > 0
    assert decode_weight_bytes(spec, 2) == (spec.matmul_parameters + 2 * spec.lookup_width) * 4
