"""``opsd-rollout eval``: a checkpoint scored on an eval file (a model whose completions are known, so the figures
are exact), the table and the JSON from the same result, and every bad input one line before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opsd_rollout.cli import build_parser, main
from opsd_rollout.train.scorers import SCORERS
from test_task_eval import known_checkpoint, problems_file, write_eval  # noqa: F401 (a fixture)


def test_eval_prints_the_table_and_writes_the_same_figures_as_json(tmp_path, known_checkpoint, capsys):
    out = tmp_path / "result.json"
    assert main(["eval", "--model", known_checkpoint, "--eval-data", str(problems_file(tmp_path)), "--eval-scorer",
                 "last-number", "--eval-samples", "4", "--eval-max-new-tokens", "6", "--prompts-per-batch", "2",
                 "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    for text in ("accuracy (greedy)", "33.3% (1 of 3)", "unextractable (greedy)", "pass@1 (mean of 4 samples)",
                 "pass@4", "4 of 12", "tokens/s"):
        assert text in printed, text
    document = json.loads(out.read_text())
    assert document["schema_version"] == 1 and document["kind"] == "task_eval"
    assert document["settings"]["eval_samples"] == 4 and document["settings"]["seed"] == 0
    result = document["result"]
    assert (result["problems"], result["correct"], result["unextractable"], result["sampled_unextractable"]) == (
        3, 1, 1, 4)
    assert result["accuracy"] == result["pass@1"] == result["pass@4"] == pytest.approx(1 / 3)
    assert result["generated_tokens"] == 7 * 5  # greedy and 4 samples alike: "42", "x", "5" and their EOS
    assert [p["completion"] for p in result["per_problem"]] == ["42", "x", "5"]
    assert [(p["line"], p["answer"], p["greedy"], p["greedy_correct"], p["correct"])
            for p in result["per_problem"]] == [(1, "42", "42", True, 4), (2, "3", None, False, 0),
                                                (3, "7", "5", False, 0)]
    assert f"{result['tokens_per_second']:,.1f}" in printed


def test_every_scorer_is_named_in_both_helps():
    for command in ("eval", "train"):
        text = next(a for a in build_parser()._subparsers._group_actions[0].choices[command]._actions
                    if "--eval-scorer" in a.option_strings).help
        assert all(scorer in text for scorer in SCORERS), (command, text)


@pytest.mark.parametrize("argv, message", [
    (["--eval-data", "{no_answer}", "--eval-scorer", "gsm8k"], "--eval-data '{no_answer}' line 2: no 'answer'"),
    (["--eval-data", "{words}", "--eval-scorer", "math"], "--eval-scorer: unknown scorer 'math'; known: gsm8k"),
    (["--eval-data", "{words}", "--eval-scorer", "exact", "--eval-samples", "0"],
     "--eval-samples must be an int >= 1"),
    (["--eval-data", "{words}", "--eval-scorer", "gsm8k"],
     "--eval-data '{words}': no 'answer' holds one the gsm8k scorer can read"),
    (["--eval-data", "{missing}", "--eval-scorer", "gsm8k"], "--eval-data '{missing}' does not exist"),
    (["--eval-data", "{words}", "--eval-scorer", "exact", "--eval-samples", "4", "--temperature", "0"],
     "--eval-samples 4 at --temperature 0, which is greedy"),
    (["--eval-data", "{words}", "--eval-scorer", "exact", "--prompts-per-batch", "0"],
     "--prompts-per-batch must be an int >= 1"),
    (["--eval-data", "{words}", "--eval-scorer", "exact", "--top-p", "0"], "top_p"),
    (["--eval-data", "{words}", "--eval-scorer", "exact", "--eval-max-new-tokens", "0"],
     "--eval-max-new-tokens must be an int >= 1"),
    (["--eval-data", "{words}", "--eval-scorer", "exact", "--seed", "-1"], "--seed must be an int >= 0"),
    (["--model", "org/hub-model", "--eval-data", "{words}", "--eval-scorer", "exact"], "never downloads"),
])
def test_bad_input_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, argv, message):
    import opsd_rollout.models as models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(models, "load_model", no_model)
    paths = {"missing": str(tmp_path / "none.jsonl"),
             "words": str(write_eval(tmp_path / "words.jsonl", [{"prompt": "a", "answer": "seventy"}])),
             "no_answer": str(write_eval(tmp_path / "no_answer.jsonl", [{"prompt": "a", "answer": 1},
                                                                         {"prompt": "b"}]))}
    model = [] if "--model" in argv else ["--model", "llama-tiny"]
    assert main(["eval", *model, *[arg.format(**paths) for arg in argv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opsd-rollout: error:") and message.format(**paths) in err, err
    assert len(err.strip().splitlines()) == 1, err
