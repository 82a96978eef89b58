"""``opsd-rollout train --teacher-url``: a served teacher in the training loop, against our server on loopback (an
in-process thread on a free port, stopped at the end). The run trains as with the same teacher in process, its
server is checked before any step, what a served teacher cannot do is refused up front, and a server that goes away
mid-run stops the run cleanly with a checkpoint and the command that continues it, after which the resumed run
holds every step once. (tests/test_served_teacher.py tests the client and the step; test_serve.py the server.)"""

from __future__ import annotations

import json
import queue
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import HOLD_HOOK, clean_env, held, holding, hook_path, release, run_named

from opsd_rollout.cli import main
from opsd_rollout.models import load_model
from opsd_rollout.serve import ServeConfig, TeacherServer
from opsd_rollout.train import TeacherSpec, TrainConfig, train
from test_train import write_prompts

TINY = dict(student="llama-tiny", prompts_per_micro_batch=2, max_new_tokens=8, eval_prompts=4, eval_every=2,
            progress=False, lr=1e-3)


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def serve(model: str, port: int = 0, name: str | None = None) -> TeacherServer:
    teacher, tokenizer = load_model(model)
    return TeacherServer(ServeConfig(model=model, served_model_name=name, port=port), model=teacher,
                         tokenizer=tokenizer).start()


@pytest.fixture(scope="module")
def qwen_server():
    server = serve("qwen2-tiny", name="qwen2-tiny")
    yield server
    server.stop()


def test_a_served_teacher_trains_as_the_same_teacher_in_process(tmp_path, qwen_server):
    """Same weights, same cache (top-k with the tail bucket): the same losses, step after step."""
    common = dict(TINY, steps=3, teacher="qwen2-tiny", teacher_cache="topk", teacher_top_k=16, top_k_rest="tail")
    here = train(TrainConfig.from_flat(dict(common, output_dir=str(tmp_path / "here"))))
    there = train(TrainConfig.from_flat(dict(common, output_dir=str(tmp_path / "there"),
                                             teacher_url=qwen_server.url)))
    losses = [r["loss"] for r in here.records[1:]]
    assert [r["loss"] for r in there.records[1:]] == pytest.approx(losses, rel=1e-3)
    assert there.records[1]["loss"] == pytest.approx(losses[0], rel=1e-5)  # before any update: the same numbers
    assert all(r["eval_reverse_kl"] > 0 for r in there.records if "eval_reverse_kl" in r)
    saved = json.loads((tmp_path / "there" / "train_config.json").read_text())
    assert [(t["source"], t["model"]) for t in saved["teachers"]] == [(qwen_server.url, "qwen2-tiny")]
    assert saved["divergence"]["top_k_rest"] == "tail"


def test_the_served_evaluation_is_zero_against_the_student_itself(tmp_path):
    """The k3 estimate of KL(student || teacher) from the sampled tokens is 0 when the teacher is the student: the
    served log-probabilities line up with the student's, token for token."""
    server = serve("llama-tiny")
    try:
        result = train(TrainConfig.from_flat(dict(TINY, steps=1, eval_every=1, output_dir=str(tmp_path / "run"),
                                                  teacher_url=server.url, loss="sampled_reverse_kl")))
    finally:
        server.stop()
    assert result.records[0]["eval_reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert result.records[1]["loss"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(teacher_url="http://127.0.0.1:{port}", teacher_timeout=0.5), "--teacher-url: the teacher server at "
                                                                       "http://127.0.0.1:{port} did not answer"),
    (dict(teacher="qwen2-small"), "qwen2-small"),
    (dict(teacher_cache="full"), "not its whole vocabulary"),
    (dict(lmbda=0.5, prompts="NOREFS"), "a served teacher scores tokens, it does not generate"),
    (dict(objective="sft"), "objective sft trains on references alone"),
    (dict(teacher_zero_stage=3), "--teacher-zero-stage: an option of an in-process teacher"),
])
def test_what_a_served_teacher_cannot_do_is_refused_before_any_step(tmp_path, monkeypatch, qwen_server, change,
                                                                    message):
    from opsd_rollout.distributed import free_port
    from opsd_rollout.train import loop

    monkeypatch.setattr(loop, "build_student_engine", lambda *a: pytest.fail("reached the engine"))
    port = free_port()
    change = {k: v.format(port=port) if isinstance(v, str) else v for k, v in change.items()}
    if change.get("prompts") == "NOREFS":
        change["prompts"] = str(write_prompts(tmp_path / "p.jsonl", reference=False))
    with pytest.raises(ValueError, match=message.format(port=port).replace("(", r"\(")):
        train(TrainConfig.from_flat({**TINY, "steps": 1, "output_dir": str(tmp_path / "run"),
                                     "teacher_url": qwen_server.url, **change}))


def test_a_missing_or_wrong_key_and_a_silent_server_are_said_by_the_flags(tmp_path, monkeypatch):
    """The messages named the library's ``ServedTeacher(api_key=...)`` and ``retry_timeout_s=``: a user of the
    command line reads its flags, and the environment variable that keeps the key off the command line."""
    from opsd_rollout.distributed import free_port

    server = TeacherServer(ServeConfig(model="qwen2-tiny", port=0, api_key="the-right-key"),
                           model=load_model("qwen2-tiny")[0], tokenizer=load_model("qwen2-tiny")[1]).start()
    monkeypatch.delenv("OPSD_ROLLOUT_API_KEY", raising=False)
    common = {**TINY, "steps": 1, "output_dir": str(tmp_path / "run"), "teacher_url": server.url}
    try:
        for key, which in ((None, "no key was given"), ("a-wrong-key", "the key given was not its own")):
            with pytest.raises(ValueError) as refused:
                train(TrainConfig.from_flat({**common, **({"teacher_api_key": key} if key else {})}))
            said = str(refused.value)
            assert said.startswith(f"--teacher-url: the teacher server at {server.url} refused GET /v1/models: HTTP "
                                   f"401") and f"; {which}: set $OPSD_ROLLOUT_API_KEY to the server's --api-key" in said
            assert "--teacher-api-key" in said and "ServedTeacher" not in said and "a-wrong-key" not in said
    finally:
        server.stop()
    nowhere = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError) as refused:
        train(TrainConfig.from_flat({**common, "teacher_url": nowhere, "teacher_timeout": 0.5}))
    assert str(refused.value).endswith("; it is retried for --teacher-timeout, 0.5 s")
    assert "retry_timeout_s" not in str(refused.value)


def test_accumulated_micro_batches_roll_out_ahead_of_their_updates_with_the_same_losses(tmp_path, qwen_server,
                                                                                        monkeypatch):
    """With gradient accumulation, every micro-batch of an optimizer step is rolled out (its teacher request sent)
    before the first update, so each request is in flight behind the next rollout; the samples, losses and gradient
    norms are those of the run that waits for each answer in turn (``--no-teacher-overlap``), and the records say
    how much of the teacher's latency was hidden."""
    from opsd_rollout.opsd import in_flight
    from opsd_rollout.opsd import step as step_module

    order = []
    start, finish = step_module.OPSDStep.start, in_flight.StepInFlight.finish

    def starting(*args, **kwargs):
        order.append("rollout")
        return start(*args, **kwargs)

    def finishing(self, *args, **kwargs):
        order.append("update")
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(step_module.OPSDStep, "start", starting)
    monkeypatch.setattr(in_flight.StepInFlight, "finish", finishing)
    common = dict(TINY, steps=2, gradient_accumulation_steps=3, samples_per_prompt=2, temperature=1.0,
                  teacher_url=qwen_server.url, teacher_cache="topk", teacher_top_k=16)
    runs = {}
    for overlap in (True, False):
        order.clear()
        runs[overlap] = train(TrainConfig.from_flat(dict(common, output_dir=str(tmp_path / str(overlap)),
                                                         teacher_overlap=overlap)))
        per_step = ["rollout"] * 3 + ["update"] * 3 if overlap else ["rollout", "update"] * 3
        assert order == per_step * 2
    ahead, waited = (runs[True].records[1:], runs[False].records[1:])
    assert [r["loss"] for r in ahead] == pytest.approx([r["loss"] for r in waited], rel=1e-6)
    assert [r["grad_norm"] for r in ahead] == pytest.approx([r["grad_norm"] for r in waited], rel=1e-6)
    assert [r["response_tokens"] for r in ahead] == [r["response_tokens"] for r in waited]
    for record in ahead + waited:
        assert record["time/teacher_latency_ms"] > 0 and 0 <= record["time/teacher_hidden_share"] <= 1
        assert record["time/teacher_forward_ms"] == 0


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_server_gone_mid_run_stops_it_with_a_checkpoint_and_resume_continues(tmp_path, monkeypatch, capsys,
                                                                               accumulation):
    """The server stops before step 3's teacher request: retried for --teacher-timeout, then the run saves step 2,
    exits 3 and prints the command that continues it; with the server back, that command finishes the run and
    metrics.jsonl holds every step once. With accumulation, step 3's micro-batches are in flight together when it
    goes: the run still stops after its first request's retries."""
    from opsd_rollout.opsd.step import OPSDStep

    server = serve("qwen2-tiny")
    port = int(server.url.rsplit(":", 1)[1])
    calls, step = [], OPSDStep.start

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * accumulation + 1:
            server.stop()
        return step(*args, **kwargs)

    monkeypatch.setattr(OPSDStep, "start", stopping)
    out = tmp_path / "run"
    argv = ["train", "--student", "llama-tiny", "--teacher-url", server.url, "--teacher-timeout", "1", "--steps", "4",
            "--prompts-per-micro-batch", "2", "--max-new-tokens", "6", "--eval-every", "2", "--eval-prompts", "4",
            "--gradient-accumulation-steps", str(accumulation), "--output-dir", str(out), "--quiet"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "stopped after step 2: the teacher server at" in err and "did not answer POST /v1/completions" in err
    assert "(each request is retried for --teacher-timeout, 1 s)" in err and "retry_timeout_s" not in err
    assert f"checkpoint {out / 'checkpoints' / 'step2'}" in err
    command = err.strip().splitlines()[-1].strip()
    assert command == "opsd-rollout " + " ".join(argv) + f" --resume {out}"
    assert [r["step"] for r in records(out)] == [0, 1, 2] and not (out / "model").exists()
    monkeypatch.setattr(OPSDStep, "start", step)
    back = serve("qwen2-tiny", port=port)
    try:
        assert main(command.split()[1:]) == 0
    finally:
        back.stop()
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4] and (out / "model" / "config.json").is_file()


def start_server(port: int, *flags: str, seen: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """``opsd-rollout serve-teacher`` in its own process on ``port`` (with ``flags``); returns it and the URL it
    printed. ``seen`` collects every line it prints, until the test ends."""
    command = [sys.executable, "-m", "opsd_rollout", "serve-teacher", "--model", "qwen2-tiny", "--port", str(port),
               *flags]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
    lines: queue.Queue[str] = queue.Queue()
    kept = seen if seen is not None else []
    threading.Thread(target=lambda: [(lines.put(line), kept.append(line)) for line in server.stdout],
                     daemon=True).start()
    deadline, seen = time.monotonic() + 300, []
    while time.monotonic() < deadline and server.poll() is None:
        try:
            seen.append(lines.get(timeout=1.0))
        except queue.Empty:
            continue
        if "serving teacher" in seen[-1]:
            return server, seen[-1].split(" at ", 1)[1].split()[0]
    server.kill()
    pytest.fail("serve-teacher did not start within 300 s:\n" + "".join(seen[-20:]), pytrace=False)


def held_run(command: list[str], tmp_path: Path) -> subprocess.Popen:
    """``command`` (a train run) started, to be held in its step 3 (``conftest.holding``)."""
    env = {**clean_env(), "PYTHONPATH": hook_path(tmp_path, HOLD_HOOK), **holding(tmp_path, 3)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def stopped_by_a_killed_server(run: subprocess.Popen, server: subprocess.Popen, tmp_path: Path) -> tuple[str, str]:
    """Kills ``server`` while ``run`` (from ``held_run``) is held in step 3, steps 0, 1 and 2 recorded, then lets
    it go and waits for it to stop; returns its stdout and stderr."""
    held(run, tmp_path)
    server.kill()
    server.wait(60)
    release(tmp_path)
    return run.communicate(timeout=600)


@pytest.mark.slow
def test_a_killed_server_stops_the_run_and_the_printed_command_finishes_it(tmp_path):
    """The real thing, in processes: serve-teacher killed (SIGKILL) while train runs; train stops with exit 3, a
    checkpoint and the command to continue; the server restarted on its port, that command finishes the run, and
    metrics.jsonl holds every step once."""
    from opsd_rollout.distributed import free_port

    port, out = free_port(), tmp_path / "run"
    server, url = start_server(port)
    command = [sys.executable, "-m", "opsd_rollout", "train", "--student", "llama-tiny", "--teacher-url", url,
               "--teacher-timeout", "3", "--steps", "8", "--prompts-per-micro-batch", "2", "--max-new-tokens", "6",
               "--eval-every", "4", "--eval-prompts", "4", "--output-dir", str(out), "--quiet"]
    run = held_run(command, tmp_path)
    try:
        _, err = stopped_by_a_killed_server(run, server, tmp_path)
        assert run.returncode == 3, err[-4000:]
        assert "did not answer POST /v1/completions" in err
        resume = shlex.split(err.strip().splitlines()[-1])
        assert resume[0] == "opsd-rollout" and resume[-2:] == ["--resume", str(out)]
        done = [r["step"] for r in records(out)]
        assert done == list(range(len(done))) and 3 <= len(done) < 9  # every step taken is recorded, once
        server, _ = start_server(port)
        finished = run_named("train resumed (about 20 s on 2 quiet cores)",
                             [sys.executable, "-m", "opsd_rollout", *resume[1:]], timeout=900, env=clean_env())
        assert finished.returncode == 0, finished.stderr[-4000:]
        assert [r["step"] for r in records(out)] == list(range(9)) and (out / "model" / "config.json").is_file()
    finally:
        run.kill()
        server.kill()


@pytest.mark.slow
def test_the_key_is_nowhere_in_what_a_run_prints_logs_or_writes(tmp_path):
    """A served teacher behind ``serve-teacher --api-key``, a run given the key on its command line (``-v``: every
    log too) that stops when the server is killed, then the printed command run with the key in
    ``$OPSD_ROLLOUT_API_KEY`` against the server restarted: the key is in none of the two runs' output, nor in any
    file of the run (metrics.jsonl, train_config.json, the checkpoints, the model), nor in what the server
    printed. The printed command names the variable instead."""
    from opsd_rollout.distributed import free_port

    key = "sk-" + "a1b2c3d4" * 4
    port, out, printed = free_port(), tmp_path / "run", []
    server, url = start_server(port, "--api-key", key, seen=printed)
    command = [sys.executable, "-m", "opsd_rollout", "-v", "train", "--student", "llama-tiny", "--teacher-url", url,
               "--teacher-api-key", key, "--teacher-timeout", "3", "--steps", "6", "--prompts-per-micro-batch", "2",
               "--max-new-tokens", "6", "--eval-every", "3", "--eval-prompts", "2", "--save-every", "1",
               "--output-dir", str(out), "--quiet"]
    run = held_run(command, tmp_path)
    try:
        first_out, first_err = stopped_by_a_killed_server(run, server, tmp_path)
        assert run.returncode == 3, first_err[-4000:]
        said = first_err.strip().splitlines()
        assert said[-2].endswith("continue with (the server key in $OPSD_ROLLOUT_API_KEY):"), said[-3:]
        resume = shlex.split(said[-1])
        assert "--teacher-api-key" not in resume and resume[-2:] == ["--resume", str(out)]
        server, _ = start_server(port, "--api-key", key, seen=printed)
        finished = run_named("train resumed (about 20 s on 2 quiet cores)",
                             [sys.executable, "-m", "opsd_rollout", *resume[1:]], timeout=900,
                             env={**clean_env(), "OPSD_ROLLOUT_API_KEY": key})
        assert finished.returncode == 0, finished.stderr[-4000:]
    finally:
        run.kill()
        server.kill()
    server.wait(60)
    texts = {"train's stdout": first_out, "train's stderr": first_err, "the resumed run's stdout": finished.stdout,
             "the resumed run's stderr": finished.stderr, "the server's output": "".join(printed)}
    assert "serving teacher" in texts["the server's output"] and "stopped after step" in first_err
    leaks = [where for where, text in texts.items() if key in text]
    files = [path for path in out.rglob("*") if path.is_file()]
    leaks += [str(path) for path in files if key.encode() in path.read_bytes()]
    assert not leaks, leaks
    assert {"metrics.jsonl", "train_config.json", "model.safetensors", "latest"} <= {path.name for path in files}


def test_a_teacher_url_alone_is_the_users_run_not_the_built_in_one(monkeypatch, tmp_path):
    """--teacher-url with no other model flag trains against that server (on the built-in corpus's prompts), never
    the built-in run's cached teacher."""
    from opsd_rollout.train import TrainResult

    import opsd_rollout.train
    from opsd_rollout.train import default

    seen = []

    def stand_in(config):
        seen.append(config)
        return TrainResult(output_dir=tmp_path, steps=0)  # a run that trained nothing

    monkeypatch.setattr(opsd_rollout.train, "train", stand_in)
    monkeypatch.setattr(default, "default_run", lambda *a, **k: pytest.fail("took the built-in run"))
    assert main(["train", "--output-dir", str(tmp_path), "--teacher-url", "http://127.0.0.1:8000"]) == 0
    assert [c.teachers for c in seen] == [(TeacherSpec(source="http://127.0.0.1:8000"),)]


def test_the_overlap_defaults_off_only_for_a_loopback_server_beside_a_cpu_student(monkeypatch):
    """Both on the same CPU cores, a request in flight competes with the student's compute (measured slower);
    a server elsewhere, or a GPU student, overlaps; what the user asks wins."""
    import torch

    from opsd_rollout.train.setup import overlaps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not overlaps(None, "http://127.0.0.1:8000") and not overlaps(None, "http://localhost:8000/")
    assert overlaps(None, "http://10.0.0.5:8000") and overlaps(True, "http://127.0.0.1:8000")
    assert not overlaps(False, "http://10.0.0.5:8000")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert overlaps(None, "http://127.0.0.1:8000")
