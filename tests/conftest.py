"""Shared fixtures: tiny preset models, a "transition" model whose next token is a chosen function of the
current one (real weights, no mocking), request builders, and the plain per-row reference rollout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch.set_num_threads(min(2, torch.get_num_threads()))

from opsd_rollout import RolloutRequest  # noqa: E402
from opsd_rollout.models import PRESETS, byte_tokenizer  # noqa: E402

TINY_PRESETS = ["llama-tiny", "qwen2-tiny", "gpt2-tiny"]

# ---- the two tiers: `make test` runs what is not marked slow, `make test-slow` the rest ----------------------------

LAUNCHERS = ("python", "torchrun", "deepspeed")
"""Programs whose start makes a test slow: a Python interpreter or a launcher of ranks."""


@pytest.fixture(autouse=True)
def _fast_tier_stays_fast(request, monkeypatch):
    """A test not marked ``slow`` may start no Python process and run no inductor compile (seconds to minutes
    each): either fails it at once with the fix, so the fast tier cannot grow slow unnoticed."""
    if request.node.get_closest_marker("slow"):
        return
    start = subprocess.Popen._execute_child

    def execute_child(popen, args, executable, *rest, **kwargs):
        program = Path(str(executable or (args if isinstance(args, (str, bytes)) else args[0]))).name
        if program.startswith(LAUNCHERS) or program == Path(sys.executable).name:
            raise AssertionError(f"this test starts {program}: mark it @pytest.mark.slow (the fast tier, `make test`, "
                                 "starts no process)")
        return start(popen, args, executable, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)
    import torch._inductor.compile_fx as compile_fx

    def no_inductor(*args, **kwargs):
        raise AssertionError("this test compiles with inductor: mark it @pytest.mark.slow, or compile with a tracing "
                             "backend (compile_options={'backend': 'aot_eager'}) to test the loop's bookkeeping")

    monkeypatch.setattr(compile_fx, "compile_fx", no_inductor)


@pytest.fixture(autouse=True)
def _handed_lengths_checked(monkeypatch):
    """Every decode loop in the suite that hands its rows' lengths to post-processing (``DecodeStats.lengths``, in
    place of the EOS search) is checked against that search on its own tokens, and every token after a row's
    length must be padding (post-processing then masks nothing): the hand-off is proven on every workload the
    suite runs (continuous batching, compaction, shared prefixes, lockstep, sampling, several EOS ids)."""
    from opsd_rollout.rollout import postprocess
    from opsd_rollout.rollout.decode.loop import DecodeLoop

    run = DecodeLoop.run

    def checked(loop):
        tokens = run(loop)
        handed = loop.stats.lengths
        if handed is not None:
            searched = postprocess.response_lengths(tokens, loop.eos)
            assert torch.equal(handed, searched), f"the decode loop's lengths {handed} != the EOS search's {searched}"
            after = postprocess.response_valid(handed, tokens.shape[1]).logical_not()
            assert bool((tokens[after] == loop.plan.pad_token_id).all()), "a token after a row's end is not padding"
        return tokens

    monkeypatch.setattr(DecodeLoop, "run", checked)


def run_named(what: str, command: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` with captured text output; past ``timeout`` seconds (at least four times what the work
    takes on 2 busy cores) the test fails naming ``what`` was slow, with what it printed so far."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"")[-4000:]
        err = (expired.stderr or b"")[-4000:]
        pytest.fail(f"{what} did not finish within {timeout:.0f} s; stdout tail:\n{out!s}\nstderr tail:\n{err!s}",
                    pytrace=False)


HOLD_HOOK = textwrap.dedent('''
    import os, signal, sys, time
    HOLD, HOLD_CALL = os.environ.get("HOLD"), int(os.environ.get("HOLD_CALL", "0"))
    argv = sys.orig_argv
    ran = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if HOLD and ran == "opsd_rollout":
        import importlib
        module, owner_name, name = os.environ["HOLD_AT"].replace(":", ".").rsplit(".", 2)
        owner = getattr(importlib.import_module(module), owner_name)
        original, calls = getattr(owner, name), []
        def held(*args, **kwargs):
            calls.append(1)
            if len(calls) == HOLD_CALL:
                open(HOLD + ".held", "a").close()
                deadline = time.monotonic() + 900
                while not os.path.exists(HOLD) and time.monotonic() < deadline:
                    time.sleep(0.05)
            return original(*args, **kwargs)
        setattr(owner, name, held)
        if os.environ.get("HOLD_UNTIL") == "signal":
            install = signal.signal
            def opening(signum, handler):
                if callable(handler) and signum in (signal.SIGTERM, signal.SIGUSR1):
                    def handle(number, frame, handler=handler):
                        handler(number, frame)
                        open(HOLD, "a").close()
                    return install(signum, handle)
                return install(signum, handler)
            signal.signal = opening
''')
"""A ``sitecustomize`` that holds an ``opsd_rollout`` process at its ``HOLD_CALL``-th call of ``HOLD_AT`` (a
method, ``module:Class.method``) until the file ``HOLD`` exists, after creating ``HOLD.held``; with
``HOLD_UNTIL=signal``, a stop signal's handler creates ``HOLD``. A test that acts on a run mid-way (a signal, a
server killed, a kill) holds it there, so that how fast the host is cannot let the run finish first (``holding``,
``held``, ``release``)."""


def hook_path(tmp_path: Path, *texts: str) -> str:
    """``PYTHONPATH`` for a subprocess with ``texts`` as its ``sitecustomize``, before the path it had."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text("\n".join(texts))
    return os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])


MICRO_BATCH = "opsd_rollout.opsd.in_flight:StepInFlight.finish"
"""Where a training run is held: call k of it is step k's micro-batch (one micro-batch a step), before its loss."""


def holding(tmp_path: Path, call: int, *, at: str = MICRO_BATCH, until_signal: bool = False) -> dict[str, str]:
    """The environment variables that hold a run (with ``HOLD_HOOK`` on its path) at call ``call`` of ``at``."""
    return {"HOLD": str(tmp_path / "released"), "HOLD_CALL": str(call), "HOLD_AT": at,
            **({"HOLD_UNTIL": "signal"} if until_signal else {})}


def held(run: subprocess.Popen, tmp_path: Path, timeout_s: float = 900) -> None:
    """Waits until ``run`` (started with ``holding(tmp_path, ...)``) is held; fails if it ends or stalls first."""
    deadline = time.monotonic() + timeout_s
    while not (tmp_path / "released.held").exists():
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            out, err = run.communicate()
            pytest.fail(f"the run ended or stalled before it was held:\n{((out or '') + (err or ''))[-4000:]}",
                        pytrace=False)
        time.sleep(0.1)


def release(tmp_path: Path) -> None:
    (tmp_path / "released").touch()


@pytest.fixture(scope="session")
def tiny_models():
    """name -> model (eval, fp32, CPU), built once per session."""
    return {name: PRESETS[name].build() for name in TINY_PRESETS}


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


def clean_env() -> dict[str, str]:
    """This process's environment without the distributed variables an in-process DeepSpeed group set, for
    subprocesses that start their own ranks."""
    from opsd_rollout.distributed import environment_without_ranks

    return environment_without_ranks()


def assert_chi_square_fit(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Sample ``counts`` per index against ``probs``: no zero-probability index drawn, and a chi-square
    goodness of fit with the cells expected under 5 pooled into one (p > 0.001)."""
    assert counts[probs == 0].sum() == 0, "a zero-probability index was drawn"
    expected = probs.double() / probs.sum() * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big].numpy(), counts[~big].sum().item())
    wanted = np.append(expected[big].numpy(), expected[~big].sum().item())
    keep = wanted > 0
    result = chisquare(observed[keep], wanted[keep] * observed[keep].sum() / wanted[keep].sum())
    assert result.pvalue > 0.001, (result, int(big.sum()))


def jsd_by_hand(p: torch.Tensor, q: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalized JSD of student ``p`` and teacher ``q`` (probabilities over the last dimension) by its formula:
    forward KL(q || p) at ``beta`` 0, reverse KL(p || q) at 1, else each side's KL to ``beta q + (1 - beta) p``."""
    if beta == 0.0:
        return (q * (q.log() - p.log())).sum(-1)
    if beta == 1.0:
        return (p * (p.log() - q.log())).sum(-1)
    m = beta * q + (1 - beta) * p
    return beta * (q * (q.log() - m.log())).sum(-1) + (1 - beta) * (p * (p.log() - m.log())).sum(-1)


def transition_model(table: list[int], *, eos_token_id=None, sharpness: float = 20.0):
    """A one-layer Llama whose greedy next token is ``table[current token]``.

    Attention and MLP write nothing (their output projections are zero), so the residual stream is the
    current token's one-hot embedding; the LM head maps it to ``table[token]`` with a large margin
    (``sharpness``), so sampling follows the table too.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(table)
    config = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=vocab,
                         max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, vocab)
        head[torch.tensor(table), torch.arange(vocab)] = sharpness / vocab**0.5
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


def chain_table(vocab: int, chains: dict[int, int]) -> list[int]:
    """Every token maps to ``(t + 1)`` wrapping inside [3, vocab), except those given in ``chains``."""
    table = [3 + ((t - 3 + 1) % (vocab - 3)) if t >= 3 else 3 for t in range(vocab)]
    for src, dst in chains.items():
        table[src] = dst
    return table


def rollout_engine(model, tokenizer, *, whole_cache: bool = False, ignore_eos: bool = False,
                   response_lengths: str | None = None, **fields):
    """A ``HybridEngineRollout`` from flat keyword arguments (``RolloutOptions``' names go into ``options``);
    ``whole_cache``: decode steps over the whole cache, masked, eagerly; ``ignore_eos``/``response_lengths``: a
    benchmark workload's lengths, through the bench's own hook (``WorkloadRollout``)."""
    from opsd_rollout.bench.workload import workload_rollout

    lengths = "fixed" if ignore_eos else response_lengths
    workload = workload_rollout(model, tokenizer, lengths or "natural", **fields)
    workload.rollout.strategy.whole_cache = whole_cache
    return workload if lengths else workload.rollout


def make_tokenizer(pad_token_id, eos_token_id):
    return SimpleNamespace(pad_token_id=pad_token_id, eos_token_id=eos_token_id)


def left_padded(prompts: list[list[int]], pad_token_id: int, *, width: int | None = None) -> RolloutRequest:
    """Left-pad token lists to one width; the mask is 1 on real tokens."""
    width = width or max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
    return RolloutRequest(ids, mask)


def prompts_with_padding_and_holes(tokenizer) -> RolloutRequest:
    """Three byte-tokenized prompts of different lengths, left-padded, with a hole in the last one."""
    enc = tokenizer(["The student writes", "hi", "distillation on policy"], padding=True, return_tensors="pt")
    mask = enc.attention_mask.clone()
    mask[2, -4] = 0
    return RolloutRequest(enc.input_ids, mask)


def reference_postprocess(sequences, prompt_ids, prompt_mask, eos_ids, pad_token_id, width=None):
    """Plain per-row version of the batch contract, for equivalence tests: ``width`` response columns (DeepSpeed's
    ``max_new_tokens``), or ``None`` for the longest response's."""
    prompt_len = prompt_ids.shape[1]
    rows = []
    for row in range(sequences.shape[0]):
        response = sequences[row, prompt_len:].tolist()
        length = len(response)
        for pos, token in enumerate(response):
            if token in eos_ids:
                length = pos + 1
                break
        rows.append((response[:length], length))
    width = max((length for _, length in rows), default=0) if width is None else width
    ids = torch.full((sequences.shape[0], prompt_len + width), pad_token_id, dtype=prompt_ids.dtype)
    mask = torch.zeros((sequences.shape[0], prompt_len + width), dtype=prompt_mask.dtype)
    for row, (response, length) in enumerate(rows):
        ids[row, :prompt_len] = prompt_ids[row]
        mask[row, :prompt_len] = prompt_mask[row]
        ids[row, prompt_len:prompt_len + length] = torch.tensor(response, dtype=prompt_ids.dtype)
        mask[row, prompt_len:prompt_len + length] = 1
    return ids, mask


def reference_rollout(model, request, *, n, max_new_tokens, pad_token_id, eos_ids, trimmed=False):
    """transformers' generate on the expanded prompts (greedy), then the per-row reference post-processing, to
    ``max_new_tokens`` response columns (the default ``response_width``) or, ``trimmed``, the longest response's."""
    ids = request.prompt_ids.repeat_interleave(n, dim=0)
    mask = request.prompt_attention_mask.repeat_interleave(n, dim=0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(eos_ids), pad_token_id=pad_token_id)
    return reference_postprocess(out, ids, mask, list(eos_ids), pad_token_id,
                                 width=None if trimmed else max_new_tokens)


def assert_batch_contract(batch, request, *, n, max_new_tokens, pad_token_id, eos_ids, trimmed=False):
    """Every clause of the RolloutBatch contract (docs/CONTRACT.md) that can be checked from the output alone:
    ``max_new_tokens`` response columns, or with ``trimmed`` (``response_width="longest"``) the longest's."""
    B, P = request.prompt_ids.shape
    ids, mask = batch.input_ids, batch.attention_mask
    assert ids.shape[0] == B * n and mask.shape == ids.shape
    R = ids.shape[1] - P
    assert 1 <= R <= max_new_tokens
    expected_prompt = request.prompt_ids.repeat_interleave(n, dim=0)
    assert torch.equal(ids[:, :P], expected_prompt)
    assert torch.equal(mask[:, :P], request.prompt_attention_mask.repeat_interleave(n, dim=0))
    assert batch.response_start_idx.dtype == torch.int64
    assert torch.equal(batch.response_start_idx, torch.full((B * n, ), P, dtype=torch.int64))
    lengths = []
    for row in range(B * n):
        response = ids[row, P:].tolist()
        eos_at = next((i for i, t in enumerate(response) if t in eos_ids), None)
        length = R if eos_at is None else eos_at + 1
        if eos_at is None:
            assert R == max_new_tokens, f"row {row} has no EOS, so it must have run to max_new_tokens"
        lengths.append(length)
        assert mask[row, P:P + length].eq(1).all(), f"row {row}: mask must be 1 up to and including EOS"
        assert mask[row, P + length:].eq(0).all(), f"row {row}: mask must be 0 after EOS"
        assert ids[row, P + length:].eq(pad_token_id).all(), f"row {row}: positions after EOS must be pad"
    if trimmed:
        assert max(lengths) == R, "response width must be the longest response"
    else:
        assert R == max_new_tokens, "response width must be max_new_tokens (DeepSpeed's)"
    return lengths
