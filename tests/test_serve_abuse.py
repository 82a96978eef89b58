"""The teacher server under abuse, on loopback in this process (a thread, a free port): a body too large (by its
Content-Length, or in chunks without one), malformed JSON, a body that never finishes, a head that never finishes,
more connections than it takes, a wrong key again and again: each refused with its status (or its connection
closed), and a good request answered meanwhile. The 10,000-request run with the server's memory measured is
``benchmarks/serve/serve_abuse.py``, run here in the slow tier."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import clean_env, run_named
from opsd_rollout.serve import EngineLimits, ServeConfig, TeacherServer
from test_serve import KEY, call

READ_TIMEOUT_S = 1.0
GOOD = {"prompt": [[5, 6, 7, 8]], "prompt_logprobs": 2}
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve" / "serve_abuse.py"


@pytest.fixture(scope="module")
def server(tiny_models, tokenizer):
    served = TeacherServer(ServeConfig(model="llama-tiny", port=0, api_key=KEY, max_connections=4,
                                       read_timeout_s=READ_TIMEOUT_S,
                                       limits=EngineLimits(max_batch_tokens=64, max_logprobs=5, max_model_len=40)),
                           model=tiny_models["llama-tiny"], tokenizer=tokenizer).start()
    yield served
    served.stop()


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def head(path: str = "/v1/completions", key: str | None = KEY, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: teacher", "Content-Type: application/json",
             *([f"Authorization: Bearer {key}"] if key else []), *(f"{k.replace('_', '-')}: {v}"
                                                                  for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(sock: socket.socket) -> tuple[int, dict, bool]:
    """The status and JSON body the server sent, and whether it closed the connection after."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the connection closed before an answer: {data!r}")
        data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    status = int(top.split()[1])
    length = int(next(line.split(b":")[1] for line in top.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:  # closed with the client's unread bytes still in its buffer: a reset, closed too
        closed = True
    return status, json.loads(rest[:length]), closed


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """Send what the server may stop reading (it answered and closed): a reset is the point."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def test_a_body_too_large_is_refused_by_its_length_or_as_it_comes(server):
    with connect(server) as sock:
        sock.sendall(head(Content_Length="1000000000"))
        status, body, closed = answer(sock)
    assert status == 413 and "max_request_bytes" in body["error"]["message"] and closed
    with connect(server) as sock:  # chunked: no length to read; refused once past the limit, never held whole
        sock.sendall(head(Transfer_Encoding="chunked"))
        chunk = b"4000\r\n" + b"1" * 0x4000 + b"\r\n"
        for _ in range(8):  # 128 KiB, over the 66,048 bytes 64 token positions allow
            send_quietly(sock, chunk)
        status, body, closed = answer(sock)
    assert status == 413 and "still coming" in body["error"]["message"] and closed
    assert call(server.url, "/v1/completions", GOOD)[0] == 200


def test_malformed_json_is_a_400_naming_the_body(server):
    payload = b'{"prompt": [[1, 2, 3]], "prompt_logprobs": '
    with connect(server) as sock:
        sock.sendall(head(Content_Length=str(len(payload))) + payload)
        status, body, _ = answer(sock)
    assert status == 400 and body["error"]["code"] == 400 and "JSON" in body["error"]["message"]


def test_a_body_that_never_finishes_is_a_408_and_good_requests_are_answered_meanwhile(server):
    with connect(server) as stalled:
        stalled.sendall(head(Content_Length="200") + b'{"prompt": [[1, 2')  # and nothing more
        assert call(server.url, "/v1/completions", GOOD)[0] == 200  # while it waits
        status, body, closed = answer(stalled)  # READ_TIMEOUT_S after its head
    assert status == 408 and "--read-timeout" in body["error"]["message"] and closed


def test_a_head_that_never_finishes_has_its_connection_closed(server):
    with connect(server) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: teacher\r\nContent-Le")
        started = time.monotonic()
        assert stalled.recv(1024) == b""  # closed by the server, READ_TIMEOUT_S after it opened
    assert time.monotonic() - started < 30  # bounded (the socket's own timeout would raise first)


def test_past_max_connections_a_request_is_a_503_until_one_closes(server):
    stalled = [connect(server) for _ in range(3)]
    try:
        for sock in stalled:
            sock.sendall(head(Content_Length="100"))
        time.sleep(0.2)  # their heads read: three requests in progress, a fourth connection is one too many
        status, _ = raw_status(server, json.dumps(GOOD).encode())
        assert status == 503
        for sock in stalled:
            assert answer(sock)[0] == 408
    finally:
        for sock in stalled:
            sock.close()
    assert call(server.url, "/v1/completions", GOOD)[0] == 200


def raw_status(server, payload: bytes) -> tuple[int, bytes]:
    with connect(server) as sock:
        sock.sendall(head(Content_Length=str(len(payload))) + payload)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
    return int(data.split()[1]), data


def test_a_wrong_key_again_and_again_is_401_each_time_and_nothing_else_waits(server):
    results, good = [], []

    def knock():
        for _ in range(50):
            results.append(call(server.url, "/v1/completions", GOOD, key="sk-wrong")[0])

    knockers = [threading.Thread(target=knock) for _ in range(2)]
    for thread in knockers:
        thread.start()
    good.append(call(server.url, "/v1/completions", GOOD)[0])
    for thread in knockers:
        thread.join(120)
    assert results == [401] * 100 and good == [200]


@pytest.mark.slow
def test_ten_thousand_bounded_requests_leave_the_servers_memory_bounded(tmp_path):
    """``benchmarks/serve/serve_abuse.py`` against ``serve-teacher`` in its own process: every fault refused with its status,
    every good request answered, and the server's resident memory after the abuse within 64 MiB of before."""
    output = tmp_path / "abuse.json"
    done = run_named("the abuse script", [sys.executable, str(SCRIPT), "--requests", "2000", "--output",
                                          str(output), "--check"], timeout=1200, env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (round_,) = json.loads(output.read_text())["rounds"]
    assert all(fault["unexpected"] == 0 for fault in round_["faults"].values()), round_["faults"]
    assert sum(fault["sent"] for fault in round_["faults"].values()) == 2000
    assert round_["good"]["answered"] == round_["good"]["sent"] > 0
    memory = json.loads(output.read_text())["server_rss_mib"]
    assert memory["after_each_round"][0] - memory["before"] <= 64
