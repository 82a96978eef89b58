"""The compact answer between ``serve-teacher`` and its client (``opsd_rollout.compact_answer``): asked for only of a
server whose ``/v1/models`` says it gives it (any other is sent vLLM's request as before); the response positions
only, its bytes what the layout says, its values the JSON answer's; a client and a server of different versions
refused both ways in one line; a malformed, truncated or non-finite answer refused at the wire naming what is wrong.
Against our server on loopback and a small fake server answering what a test gives it (threads of this process, free
ports, every request bounded in time)."""

from __future__ import annotations

import copy
import json
import re
import struct
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from opsd_rollout import compact_answer
from opsd_rollout.compact_answer import HEADER, VERSION, content_type
from opsd_rollout.opsd import ServedTeacher, TeacherCacheConfig
from opsd_rollout.opsd.served import rows_to_send
from opsd_rollout.opsd.served_wire import read_response, request_body
from opsd_rollout.opsd.targets import ResponseTargets
from opsd_rollout.serve import ServeConfig, TeacherServer

K = 3


@pytest.fixture(scope="module")
def server(tiny_models, tokenizer):
    served = TeacherServer(ServeConfig(model="llama-tiny", served_model_name="teacher", port=0),
                           model=tiny_models["llama-tiny"], tokenizer=tokenizer).start()
    yield served
    served.stop()


def targets() -> ResponseTargets:
    """Two rows, the second left-padded: sent as [5..10] from position 3 and [3..6] from position 1."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    return ResponseTargets(ids, mask, 3, ids[:, 3:], mask[:, 3:].bool())


SENT, POSITIONS, _ = rows_to_send(targets())


def post(url: str, body: dict, accept: str) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def compact(url: str, k: int = K, dtype: str = "float32", rows=SENT, positions=POSITIONS) -> bytes:
    _, body = request_body("vllm", "teacher", rows, k, starts=[p[0] for p in positions], dtype=dtype)
    status, kind, answer = post(url, body, content_type())
    assert status == 200 and kind == content_type(), answer[:300]
    return answer


def test_rows_and_positions_are_what_the_tests_say():
    assert SENT == [[5, 6, 7, 8, 9, 10], [3, 4, 5, 6]] and POSITIONS == [[3, 4, 5], [1, 2, 3]]


def test_our_server_lists_its_version_and_a_json_only_one_lists_none(server, tiny_models, tokenizer):
    card = json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=60).read())["data"][0]
    assert card["compact_answer_version"] == VERSION
    plain = TeacherServer(ServeConfig(model="llama-tiny", port=0, compact_answers=False),
                          model=tiny_models["llama-tiny"], tokenizer=tokenizer).start()
    try:
        card = json.loads(urllib.request.urlopen(plain.url + "/v1/models", timeout=60).read())["data"][0]
        assert card["compact_answer_version"] is None
        _, body = request_body("vllm", "llama-tiny", SENT, K)
        status, kind, _ = post(plain.url, body, content_type())  # asked anyway: vLLM's JSON, as vLLM answers
        assert status == 200 and kind == "application/json"
    finally:
        plain.stop()


@pytest.mark.parametrize("k,dtype", [(K, "float32"), (K, "bfloat16"), (0, "float32"), (2, "float16")])
def test_the_compact_answer_is_the_response_positions_of_the_json_one(server, k, dtype):
    """Its size is the layout's (a header, 8 bytes a row, k ids and max(k, 1) values a position, none for the
    prompt's positions); its values are the JSON answer's at those positions, in the dtype asked."""
    body = compact(server.url, k, dtype)
    answered = sum(len(row) - wanted[0] for row, wanted in zip(SENT, POSITIONS))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    assert len(body) == HEADER.size + 8 * len(SENT) + answered * (4 * k + itemsize * max(k, 1))
    rows = compact_answer.read(bytearray(body), SENT, POSITIONS, k, dtype, vocab_size=259)
    _, json_body = request_body("vllm", "teacher", SENT, k)
    _, _, raw = post(server.url, json_body, "application/json")
    for (values, ids), reference in zip(rows, read_response("vllm", json.loads(raw), SENT, POSITIONS, k, 259)):
        expected = reference.token if k == 0 else reference.top_logprobs
        assert values.dtype == getattr(torch, dtype) and values.shape == expected.shape
        torch.testing.assert_close(values.double(), expected.to(values.dtype).double(), rtol=0, atol=1e-6)
        assert ids is None if k == 0 else torch.equal(ids, reference.top_ids)


def test_a_client_of_another_version_is_refused_by_the_server_in_one_line(server):
    _, body = request_body("vllm", "teacher", SENT, K, starts=[3, 1], dtype="float32")
    status, _, answer = post(server.url, body, content_type(VERSION + 1))
    message = json.loads(answer)["error"]["message"]
    assert status == 406 and f"version {VERSION}" in message and f"version {VERSION + 1}" in message
    assert "\n" not in message
    status, _, answer = post(server.url, body, compact_answer.MEDIA_TYPE)
    assert status == 406 and "without a version" in json.loads(answer)["error"]["message"]


@pytest.mark.parametrize("change,field", [
    ({"prompt_logprobs_start": [3]}, "prompt_logprobs_start: 1 starts for 2 prompts"),
    ({"prompt_logprobs_start": [3, 4]}, "prompt_logprobs_start\\[1\\]: 4 is past prompt 1's last position 3"),
    ({"prompt_logprobs_start": [0, 1]}, "prompt_logprobs_start.0"),
    ({"prompt_logprobs_dtype": "float64"}, "prompt_logprobs_dtype"),
])
def test_a_bad_compact_request_is_refused_naming_the_field(server, change, field):
    _, body = request_body("vllm", "teacher", SENT, K, starts=[3, 1], dtype="float32")
    status, _, answer = post(server.url, {**body, **change}, content_type())
    assert status == 400
    assert re.search(field, json.loads(answer)["error"]["message"]), answer


def test_our_fields_without_the_compact_answer_are_refused(server):
    _, body = request_body("vllm", "teacher", SENT, K, starts=[3, 1], dtype="float32")
    status, _, answer = post(server.url, body, "application/json")
    assert status == 400 and "read with the compact answer only" in json.loads(answer)["error"]["message"]


class Fake:
    """A teacher server that lists ``version`` in its card and answers ``/v1/completions`` with ``body`` as
    ``kind``, declaring ``declared`` bytes (``None``: the body's own length); it records each request."""

    def __init__(self, version: int | None = VERSION):
        self.version, self.body, self.kind, self.declared = version, b"", content_type(), None
        self.requests: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                card = {"id": "teacher", "object": "model", "vocab_size": 259, "compact_answer_version": fake.version}
                self.answer(json.dumps({"object": "list", "data": [card]} if self.path == "/v1/models"
                                       else {"status": "ok"}).encode(), "application/json")

            def do_POST(self):
                sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.headers["Accept"], sent))
                self.answer(fake.body, fake.kind, fake.declared)

            def answer(self, body: bytes, kind: str, declared: int | None = None):
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body) if declared is None else declared))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def fake():
    served = Fake()
    yield served
    served.stop()


def client(url: str) -> ServedTeacher:
    return ServedTeacher(url, request_timeout_s=30, retry_timeout_s=0)


TOPK = TeacherCacheConfig(mode="topk", top_k=K)


def test_a_server_of_another_version_is_refused_by_the_client_in_one_line():
    fake = Fake(version=VERSION + 1)
    try:
        with pytest.raises(ValueError, match=f"gives the compact answer version {VERSION + 1}, and this client reads "
                                             f"version {VERSION}") as refused:
            client(fake.url).connect()
        assert "\n" not in str(refused.value) and fake.requests == []
    finally:
        fake.stop()


def test_a_server_that_does_not_list_it_gets_todays_request(server):
    """A vLLM server (no ``compact_answer_version`` in its card) is sent vLLM's request, unchanged, and read as JSON."""
    fake = Fake(version=None)
    try:
        _, today = request_body("vllm", "teacher", SENT, K)
        fake.body, fake.kind = post(server.url, today, "application/json")[2], "application/json"
        cache = client(fake.url).build_cache(targets(), TOPK)
        assert fake.requests == [("application/json", today)]
        assert cache.indices.shape == (2, 3, K)
    finally:
        fake.stop()


def header(body: bytes, **fields) -> bytes:
    """``body`` with header fields replaced."""
    names = ("magic", "version", "values", "ids", "k", "rows", "positions")
    values = dict(zip(names, HEADER.unpack_from(body)))
    values.update(fields)
    return HEADER.pack(*(values[name] for name in names)) + body[HEADER.size:]


def value_at(body: bytes, flat: int, value: float) -> bytes:
    """``body`` with its float32 value number ``flat`` set to ``value``."""
    rows, positions = HEADER.unpack_from(body)[5:7]
    at = HEADER.size + 8 * rows + 4 * K * positions + 4 * flat
    return body[:at] + struct.pack("<f", value) + body[at + 4:]


def id_at(body: bytes, flat: int, token: int) -> bytes:
    at = HEADER.size + 8 * HEADER.unpack_from(body)[5] + 4 * flat
    return body[:at] + struct.pack("<i", token) + body[at + 4:]


BROKEN = [
    (lambda b: b[:-3], "is 181 bytes and its header describes 184 .*: truncated"),
    (lambda b: b + b"\0" * 4, "bytes past its end"),
    (lambda b: b[:10], "is 10 bytes, shorter than its 24-byte header"),
    (lambda b: b"JSON" + b[4:], "starts with b'JSON'.*not a compact answer"),
    (lambda b: header(b, version=VERSION + 1), f"is version {VERSION + 1}, and this client reads version {VERSION}"),
    (lambda b: header(b, values=9), "values' dtype code 9: expected one of 1 \\(float32\\)"),
    (lambda b: header(b, values=2), "has values in bfloat16: float32 was asked"),
    (lambda b: header(b, ids=0), "ids' dtype code 0 \\(none\\): expected 1 for k=3"),
    (lambda b: header(b, k=4), "answers k=4 for 2 rows: k=3 for 2 rows were asked"),
    (lambda b: header(b, positions=7), "is 184 bytes and its header describes 208"),
    (lambda b: header(b, positions=7) + b"\0" * 8 * K, "has 7 positions in its header and 6 in its rows"),
    (lambda b: b[:HEADER.size] + struct.pack("<I", 2) + b[HEADER.size + 4:], "answers 2 positions of row 0: 3"),
    (lambda b: b[:HEADER.size + 4] + struct.pack("<I", 7) + b[HEADER.size + 8:], "row 0 for other tokens"),
    (lambda b: value_at(b, 3 * K + 1, float("nan")), "values\\[row 1, position 1\\] logprob nan: expected a finite"),
    (lambda b: value_at(b, 0, float("-inf")), "values\\[row 0, position 3\\] logprob -inf"),
    (lambda b: value_at(b, K * 5, 0.5), "values\\[row 1, position 3\\] logprob 0.5"),
    (lambda b: id_at(b, K * 4 + 2, 300), "token id 300 at ids\\[row 1, position 2\\], outside the vocabulary"),
    (lambda b: value_at(b, 2, -0.001), "values\\[row 0, position 3\\]'s top 3 out of order"),
]


@pytest.mark.parametrize("change,message", BROKEN)
def test_a_broken_compact_answer_is_refused_at_the_wire_naming_what_is_wrong(server, fake, change, message):
    good = compact(server.url)
    assert len(good) == 184
    fake.body = change(good)
    with pytest.raises(ValueError, match=message):
        client(fake.url).build_cache(targets(), TOPK)
    assert fake.requests[0][0] == content_type()


def test_the_good_answer_through_the_fake_fills_the_cache(server, fake):
    fake.body = compact(server.url)
    cache = client(fake.url).build_cache(targets(), TOPK)
    assert bool((cache.values <= 0).all()) and cache.indices.dtype == torch.int32


def test_a_transfer_cut_short_is_retried_then_named(server, fake):
    fake.body = compact(server.url)
    fake.declared = len(fake.body) + 100
    with pytest.raises(ConnectionError, match="ended after 184 of its 284 bytes"):
        client(fake.url).build_cache(targets(), TOPK)


def test_an_answer_in_another_media_type_is_refused(fake):
    fake.body, fake.kind = b'{"choices": []}', "application/json"
    with pytest.raises(ValueError, match="answered POST /v1/completions with application/json, not"):
        client(fake.url).build_cache(targets(), TOPK)


def test_the_server_refuses_to_send_a_non_finite_log_probability(tiny_models, tokenizer):
    """A broken teacher (NaN logits) is the server's 500, naming the prompt and position, in either form."""
    broken = copy.deepcopy(tiny_models["llama-tiny"])
    with torch.no_grad():
        broken.lm_head.weight[7] = float("nan")
    served = TeacherServer(ServeConfig(model="broken", port=0), model=broken, tokenizer=tokenizer).start()
    try:
        for accept, extra in (("application/json", {}), (content_type(), {"prompt_logprobs_start": [3, 1]})):
            _, body = request_body("vllm", "broken", SENT, K)
            status, _, answer = post(served.url, {**body, **extra}, accept)
            assert status == 500, answer
            assert "prompt 0 position " in json.loads(answer)["error"]["message"] and "logprob nan" in answer.decode()
        with pytest.raises(ValueError, match="HTTP 500: the teacher's response has prompt 0 position 3 logprob nan"):
            client(served.url).build_cache(targets(), TOPK)
    finally:
        served.stop()
