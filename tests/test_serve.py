"""The teacher server (``opsd-rollout serve-teacher``), on loopback in this process (a thread, a free port, stopped
at the end): vLLM's shapes for /v1/completions' prompt_logprobs, /v1/models, /tokenize and /health; the values are
the teacher's log-probabilities; the bearer key; every limit refused with a 4xx naming it; the queue bounded; queued
requests batched into one forward up to the token budget."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from opsd_rollout.serve import EngineLimits, ServeConfig, TeacherServer
from opsd_rollout.serve.engine import LimitExceeded, TeacherEngine
from opsd_rollout.serve.protocol import CompletionResponse

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tiny_models, tokenizer):
    served = TeacherServer(ServeConfig(model="llama-tiny", port=0, api_key=KEY,
                                       limits=EngineLimits(max_batch_tokens=64, max_logprobs=5, max_model_len=40)),
                           model=tiny_models["llama-tiny"], tokenizer=tokenizer).start()
    yield served
    served.stop()


def call(url: str, path: str, payload=None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_health_needs_no_key_and_everything_else_does(server):
    assert call(server.url, "/health", key=None) == (200, {"status": "ok"})
    for key in (None, "wrong"):
        status, body = call(server.url, "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == 401 and "Bearer" in body["error"]["message"]
        status, _ = call(server.url, "/v1/completions", {"prompt": [1, 2], "prompt_logprobs": 1}, key=key)
        assert status == 401


def test_models_and_tokenize_have_vllms_shapes(server, tokenizer):
    status, listing = call(server.url, "/v1/models")
    assert status == 200 and listing["object"] == "list"
    card = listing["data"][0]
    assert (card["id"], card["object"], card["max_model_len"], card["vocab_size"], card["max_logprobs"]) == \
        ("llama-tiny", "model", 40, 259, 5)
    status, answer = call(server.url, "/tokenize", {"prompt": "hello there", "add_special_tokens": False})
    expected = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    assert status == 200 and answer["tokens"] == expected and answer["count"] == len(expected)


def test_prompt_logprobs_are_the_teachers_with_vllms_shape(server, tiny_models):
    rows = [[5, 40, 41, 42, 43], [7, 8]]
    status, body = call(server.url, "/v1/completions", {"model": "llama-tiny", "prompt": rows, "max_tokens": 1,
                                                        "prompt_logprobs": 3, "return_token_ids": True})
    assert status == 200 and body["object"] == "text_completion" and len(body["choices"]) == 2
    CompletionResponse.model_validate(body)  # the schema the protocol module declares (vLLM's)
    for index, row in enumerate(rows):
        choice = body["choices"][index]
        assert choice["index"] == index and choice["prompt_token_ids"] == row
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(row) and entries[0] is None
        with torch.no_grad():
            logp = torch.log_softmax(tiny_models["llama-tiny"](torch.tensor([row])).logits[0].float(), -1)
        for t in range(1, len(row)):
            entry = {int(token): value for token, value in entries[t].items()}
            top = torch.topk(logp[t - 1], 3)
            assert [token for token, v in entry.items() if v["rank"] <= 3] == top.indices.tolist()
            assert entry[row[t]]["logprob"] == pytest.approx(float(logp[t - 1, row[t]]), abs=1e-5)
            assert entry[row[t]]["rank"] == int((logp[t - 1] > logp[t - 1, row[t]]).sum()) + 1
            assert len(entry) in (3, 4), "the top 3 and the given token's own"


@pytest.mark.parametrize("payload,status,limit", [
    ({"prompt": [1, 2, 3], "prompt_logprobs": 6}, 400, "max_logprobs"),
    ({"prompt": list(range(1, 42)), "prompt_logprobs": 1}, 400, "max_model_len"),
    ({"prompt": [[1] * 30, [2] * 30, [3] * 30], "prompt_logprobs": 1}, 413, "max_batch_tokens"),
    ({"prompt": [1, 300], "prompt_logprobs": 1}, 400, "vocabulary"),
    ({"prompt": "text", "prompt_logprobs": 1}, 400, "prompt"),
    ({"prompt": [1, 2], "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"prompt": [1, 2], "model": "other"}, 404, "not served here"),
    ({"prompt": [1, 2], "stream": True}, 400, "stream"),
])
def test_a_request_over_a_limit_is_a_4xx_naming_it(server, payload, status, limit):
    got, body = call(server.url, "/v1/completions", payload)
    assert got == status and body["error"]["code"] == status
    assert limit in body["error"]["message"] or limit == body["error"]["param"], body


def test_a_body_larger_than_any_request_the_engine_runs_is_refused_unread(server):
    """75 kB of token ids, over what 64 token positions take as JSON (and small enough for the socket's buffer, so
    the client reads the answer rather than a reset)."""
    status, body = call(server.url, "/v1/completions", {"prompt": [1] * 25_000, "prompt_logprobs": 1})
    assert status == 413 and "max_request_bytes" in body["error"]["message"]


class Gate(torch.nn.Module):
    """A teacher whose forward waits for ``release``: the engine's thread holds a batch while a test queues more."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, **kwargs):
        self.entered.set()
        assert self.release.wait(60), "the test never released the teacher"
        return self.model(**kwargs)


def test_the_queue_is_bounded_and_refused_past_it_with_429(tiny_models, tokenizer):
    gate = Gate(tiny_models["llama-tiny"])
    served = TeacherServer(ServeConfig(model="gate", port=0, limits=EngineLimits(max_queue=1)), model=gate,
                           tokenizer=tokenizer).start()
    try:
        running = served.engine.submit([[1, 2, 3]], 1)  # taken by the engine's thread, held in the forward
        assert gate.entered.wait(60)
        waiting = served.engine.submit([[4, 5, 6]], 1)  # the queue's one place
        status, body = call(served.url, "/v1/completions", {"prompt": [7, 8], "prompt_logprobs": 1}, key=None)
        assert status == 429 and "max_queue" in body["error"]["message"]
        with pytest.raises(LimitExceeded, match="queue is full"):
            served.engine.submit([[9, 10]], 1)
        gate.release.set()
        assert len(running.result(60)) == len(waiting.result(60)) == 1
        assert call(served.url, "/v1/completions", {"prompt": [7, 8], "prompt_logprobs": 1}, key=None)[0] == 200
    finally:
        gate.release.set()
        served.stop()


def test_queued_requests_are_batched_up_to_the_token_budget_with_each_ones_answer(tiny_models):
    gate = Gate(tiny_models["llama-tiny"])
    engine = TeacherEngine(gate, EngineLimits(max_batch_tokens=24, max_queue=8), vocab_size=259)
    try:
        first = engine.submit([[1, 2, 3]], 2)
        assert gate.entered.wait(60)
        rows = [[[10, 11, 12, 13]], [[20, 21], [22, 23, 24, 25]], [[30, 31, 32]], [[40] * 6, [41] * 6]]
        futures = [engine.submit(r, k) for r, k in zip(rows, (1, 3, 0, 2))]  # 4 rows x 4 fit 24; 6 x 6 do not
        gate.release.set()
        answers = [f.result(60) for f in [first, *futures]]
        assert engine.batches == 3, "the first alone, then three requests in one forward, then the last"
        for request, k, answer in zip(rows, (1, 3, 0, 2), answers[1:]):
            for row, scores in zip(request, answer):
                alone = engine.score([row], k)[0]
                assert torch.equal(scores.top_ids, alone.top_ids) and scores.top_ids.shape == (len(row) - 1, k)
                torch.testing.assert_close(scores.token_logprobs, alone.token_logprobs, rtol=1e-5, atol=1e-5)
    finally:
        gate.release.set()
        engine.close()


def test_the_server_binds_to_loopback_by_default_and_checks_its_settings():
    assert ServeConfig(model="llama-tiny").host == "127.0.0.1"
    with pytest.raises(ValueError, match="api_key"):
        ServeConfig(model="llama-tiny", api_key="")
    with pytest.raises(ValueError, match="max_queue"):
        EngineLimits(max_queue=0)


def test_the_client_sends_the_key_and_says_when_it_has_none(server):
    from opsd_rollout.opsd import ServedTeacher

    with pytest.raises(ValueError, match="HTTP 401.*ServedTeacher\\(api_key=...\\)"):
        ServedTeacher(server.url).connect()
    keyed = ServedTeacher(server.url, api_key=KEY)
    keyed.connect(259)
    assert keyed.model == "llama-tiny"


def test_a_taken_port_is_refused_in_one_line_before_the_model_loads(monkeypatch, capsys):
    """It was a 14-line traceback after seconds of loading the model."""
    import socket

    from opsd_rollout.cli import main
    from opsd_rollout.serve import server as server_module

    monkeypatch.setattr(server_module, "TeacherServer", lambda *a, **k: pytest.fail("loaded the model"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve-teacher", "--model", "llama-tiny", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (f"opsd-rollout: error: --port {port} is taken on 127.0.0.1: another process "
                                       "listens on it; choose another port (--port 0 takes a free one and prints it)\n")


def test_the_ready_line_says_the_limits_by_their_flags(tiny_models, tokenizer):
    """It printed ``EngineLimits(max_batch_tokens=8192, ...)``, a Python repr (here the model's 1,024 positions
    bound the prompt)."""
    import io
    import time

    from opsd_rollout.cli import build_parser

    served = TeacherServer(ServeConfig(model="llama-tiny", port=0), model=tiny_models["llama-tiny"],
                           tokenizer=tokenizer)
    out = io.StringIO()
    thread = threading.Thread(target=served.serve, args=(out,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while "serving teacher" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    served.stop()
    thread.join(60)
    line = out.getvalue().strip()
    assert line.endswith("no key; up to 8,192 tokens a forward (--max-batch-tokens), 64 requests waiting "
                         "(--max-queue), top-64 log-probabilities (--max-logprobs), 1,024 tokens a prompt "
                         "(--max-model-len))"), line
    serve_flags = build_parser()._subparsers._group_actions[0].choices["serve-teacher"]._option_string_actions
    assert all(flag in serve_flags for flag in ("--max-batch-tokens", "--max-queue", "--max-logprobs",
                                                "--max-model-len"))
