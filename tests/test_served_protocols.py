"""The served teacher's client reads vLLM's and SGLang's responses, hand-written here from their schemas (vLLM's
``CompletionResponse`` with ``prompt_logprobs: list[dict[int, Logprob] | None]``; SGLang's ``/generate`` result
with ``meta_info.input_token_logprobs`` / ``input_top_logprobs`` as ``[logprob, token id, text]`` triples), and
refuses a malformed, short, out-of-order or non-finite response with a ValueError naming the field."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from opsd_rollout.opsd.served import rows_to_send
from opsd_rollout.opsd.served_wire import read_response, request_body
from opsd_rollout.opsd.targets import ResponseTargets

ROWS = [[11, 12, 13, 14], [21, 22, 23]]
POSITIONS = [[2, 3], [1, 2]]
"""The wanted positions: each row's response tokens."""


def vllm_fixture() -> dict:
    """A vLLM /v1/completions response (prompt_logprobs=2, return_token_ids): per position the top 2 with ranks
    1 and 2, and the given token with its own rank when it is not among them; JSON keys are strings."""
    def entry(given: int, top: list[tuple[int, float]], given_logprob: float, rank: int) -> dict:
        out = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": None} for r, (t, lp) in enumerate(top)}
        out.setdefault(str(given), {"logprob": given_logprob, "rank": rank, "decoded_token": "x"})
        return out

    return json.loads(json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "teacher",
        "usage": {"prompt_tokens": 7, "total_tokens": 8, "completion_tokens": 1},
        "choices": [
            {"index": 0, "text": "!", "logprobs": None, "finish_reason": "length", "stop_reason": None,
             "prompt_token_ids": ROWS[0],
             "prompt_logprobs": [None, entry(12, [(12, -0.1), (5, -2.5)], -0.1, 1),
                                 entry(13, [(7, -0.2), (13, -1.9)], -1.9, 2),
                                 entry(14, [(8, -0.05), (9, -3.0)], -6.0, 40)]},
            {"index": 1, "text": "!", "logprobs": None, "finish_reason": "length", "stop_reason": None,
             "prompt_token_ids": ROWS[1],
             "prompt_logprobs": [None, entry(22, [(22, -0.3), (1, -1.4)], -0.3, 1),
                                 entry(23, [(2, -0.7), (3, -0.9)], -4.0, 9)]},
        ]}))


def sglang_fixture() -> list:
    """SGLang /generate for a batch of input_ids (return_logprob, logprob_start_len=0, top_logprobs_num=2,
    return_text_in_logprobs false: the text is null); the first position's logprob is null."""
    def result(tokens, given, tops):
        return {"text": "!", "output_ids": [0],
                "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(tokens),
                              "completion_tokens": 1, "cached_tokens": 0,
                              "input_token_logprobs": [[lp, t, None] for lp, t in zip(given, tokens)],
                              "input_top_logprobs": [None if top is None else [[lp, t, None] for t, lp in top]
                                                     for top in tops],
                              "output_token_logprobs": [[-0.1, 0, None]], "output_top_logprobs": [[[-0.1, 0, None]]]}}

    return [result(ROWS[0], [None, -0.1, -1.9, -6.0], [None, [(12, -0.1), (5, -2.5)], [(7, -0.2), (13, -1.9)],
                                                       [(8, -0.05), (9, -3.0)]]),
            result(ROWS[1], [None, -0.3, -4.0], [None, [(22, -0.3), (1, -1.4)], [(2, -0.7), (3, -0.9)]])]


@pytest.mark.parametrize("protocol,fixture", [("vllm", vllm_fixture), ("sglang", sglang_fixture)])
def test_both_protocols_read_the_given_tokens_and_the_top_k(protocol, fixture):
    rows = read_response(protocol, fixture(), ROWS, POSITIONS, 2, vocab_size=100)
    assert [r.token.tolist() for r in rows] == [[-1.9, -6.0], [-0.3, -4.0]]
    assert [r.top_ids.tolist() for r in rows] == [[[7, 13], [8, 9]], [[22, 1], [2, 3]]]
    assert [r.top_logprobs.tolist() for r in rows] == [[[-0.2, -1.9], [-0.05, -3.0]], [[-0.3, -1.4], [-0.7, -0.9]]]
    assert rows[0].top_ids.dtype == torch.int32 and rows[0].token.dtype == rows[0].top_logprobs.dtype == torch.float64
    sampled = read_response(protocol, fixture(), ROWS, POSITIONS, 0, vocab_size=100)
    assert [r.token.tolist() for r in sampled] == [[-1.9, -6.0], [-0.3, -4.0]] and sampled[0].top_ids.shape == (2, 0)


def test_request_bodies_follow_each_servers_api():
    path, body = request_body("vllm", "teacher", ROWS, 4)
    assert path == "/v1/completions" and body["prompt"] == ROWS and body["prompt_logprobs"] == 4
    assert body["max_tokens"] == 1 and body["model"] == "teacher"
    path, body = request_body("sglang", "teacher", ROWS, 4)
    assert path == "/generate" and body["input_ids"] == ROWS and body["top_logprobs_num"] == 4
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0


def broken(fixture, change):
    body = copy.deepcopy(fixture())
    change(body)
    return body


VLLM_BROKEN = [
    (lambda b: b.pop("choices"), "lacks choices"),
    (lambda b: b["choices"].pop(), "1 choices for 2 prompts"),
    (lambda b: b["choices"].reverse(), "out of order: choices\\[0\\].index is 1"),
    (lambda b: b["choices"][1].update(prompt_token_ids=[21, 22, 99]), "choices\\[1\\].prompt_token_ids"),
    (lambda b: b["choices"][0].pop("prompt_logprobs"), "lacks choices\\[0\\].prompt_logprobs"),
    (lambda b: b["choices"][0]["prompt_logprobs"].pop(), "3 positions in choices\\[0\\].prompt_logprobs for 4"),
    (lambda b: b["choices"][0]["prompt_logprobs"][2].pop("13"), "lacks the given token 13 in "
                                                                "choices\\[0\\].prompt_logprobs\\[2\\]"),
    (lambda b: b["choices"][0]["prompt_logprobs"][3]["8"].update(logprob=float("nan")),
     "choices\\[0\\].prompt_logprobs\\[3\\] logprob nan"),
    (lambda b: b["choices"][0]["prompt_logprobs"][3]["8"].update(logprob=float("-inf")), "logprob -inf"),
    (lambda b: b["choices"][1]["prompt_logprobs"][2]["2"].update(logprob=0.5), "expected a finite log-probability"),
    (lambda b: b["choices"][1]["prompt_logprobs"][1].pop("1"), "1 tokens in choices\\[1\\].prompt_logprobs\\[1\\], "
                                                               "fewer than the top 2"),
    (lambda b: b["choices"][1]["prompt_logprobs"][2]["3"].update(logprob=-0.1), "top 2 out of order"),
    (lambda b: b["choices"][1]["prompt_logprobs"][2].update({"500": {"logprob": -9.0, "rank": 3}}),
     "token id 500 in choices\\[1\\].prompt_logprobs\\[2\\], outside the vocabulary"),
    (lambda b: b["choices"][0]["prompt_logprobs"][2]["7"].pop("logprob"), "lacks choices\\[0\\].prompt_logprobs\\[2\\]"
                                                                          "\\['7'\\].logprob"),
    (lambda b: b["choices"][0]["prompt_logprobs"].__setitem__(3, None), "choices\\[0\\].prompt_logprobs\\[3\\] = None"),
]


@pytest.mark.parametrize("change,message", VLLM_BROKEN)
def test_a_broken_vllm_response_is_an_error_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        read_response("vllm", broken(vllm_fixture, change), ROWS, POSITIONS, 2, vocab_size=100)


SGLANG_BROKEN = [
    (lambda b: b.pop(), "1 results for 2 prompts"),
    (lambda b: b[0].pop("meta_info"), "lacks \\[0\\].meta_info"),
    (lambda b: b[0]["meta_info"].pop("input_token_logprobs"), "lacks \\[0\\].meta_info.input_token_logprobs"),
    (lambda b: b[1]["meta_info"]["input_token_logprobs"].pop(), "input_top_logprobs of 3 positions for 2"),
    (lambda b: b.reverse(), "3 positions in \\[0\\].meta_info.input_token_logprobs for 4 tokens sent"),
    (lambda b: b[0]["meta_info"]["input_token_logprobs"][2].__setitem__(1, 12),
     "out of order: \\[0\\].meta_info.input_token_logprobs\\[2\\] is token 12"),
    (lambda b: b[0]["meta_info"]["input_token_logprobs"][3].__setitem__(0, float("nan")), "logprob nan"),
    (lambda b: b[0]["meta_info"]["input_top_logprobs"][3].pop(), "fewer than the top 2"),
    (lambda b: b[0]["meta_info"]["input_top_logprobs"][2][0].__setitem__(1, "7"), "token id '7'"),
]


@pytest.mark.parametrize("change,message", SGLANG_BROKEN)
def test_a_broken_sglang_response_is_an_error_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        read_response("sglang", broken(sglang_fixture, change), ROWS, POSITIONS, 2, vocab_size=100)


def test_what_is_sent_is_each_rows_real_tokens_up_to_its_last_trained_one():
    """Left padding and a hole in the mask are left out; positions index the tokens sent; a row with nothing to
    train on sends nothing."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 0],
                        [4, 3, 2, 1, 10, 11, 0, 0],
                        [0, 1, 2, 3, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0],
                         [1, 0, 1, 1, 1, 1, 0, 0],
                         [0, 1, 1, 1, 0, 0, 0, 0]])
    targets = ResponseTargets(ids, mask, 4, ids[:, 4:], mask[:, 4:].bool())
    sent, positions, places = rows_to_send(targets)
    assert sent == [[5, 6, 7, 8, 9], [4, 2, 1, 10, 11]]
    assert positions == [[2, 3, 4], [3, 4]]
    assert [(row, cols.tolist()) for row, cols in places] == [(0, [0, 1, 2]), (1, [0, 1])]


def test_a_nan_in_json_is_refused_too():
    text = json.dumps(vllm_fixture()).replace('"logprob": -0.05', '"logprob": NaN')
    with pytest.raises(ValueError, match="logprob nan"):
        read_response("vllm", json.loads(text), ROWS, POSITIONS, 2, vocab_size=None)
    assert math.isnan(json.loads('{"a": NaN}')["a"])
