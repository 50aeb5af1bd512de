"""The evals' arithmetic: per-position conformance measures and the task scorers."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.evals.conformance import compare_position
from tokenmill.evals.scorers import DEMO_TASKS, Task, load_tasks, parse_task, score


def test_identical_distributions_agree_with_zero_kl_and_error() -> None:
    ref = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, -1.0]), dim=0)
    top = {0: float(ref[0]), 1: float(ref[1])}
    agree, kl, error = compare_position(ref, 0, float(ref[0]), top)
    assert agree and kl == pytest.approx(0, abs=1e-12) and error == pytest.approx(0, abs=1e-7)


def test_kl_over_the_listed_tokens_and_the_rest_of_the_vocabulary() -> None:
    ref = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    # The server lists tokens 1 and 0 with other probabilities; the rest bucket holds 0.2 vs 0.1.
    server = {1: math.log(0.6), 0: math.log(0.3)}
    agree, kl, error = compare_position(ref, 1, math.log(0.6), server)
    expected = 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.6) + 0.2 * math.log(0.2 / 0.1)
    assert not agree  # the reference's top token is 0, the server sampled 1
    assert kl == pytest.approx(expected, rel=1e-6)
    assert error == pytest.approx(abs(math.log(0.3) - math.log(0.6)), rel=1e-6)


def _task(**fields) -> Task:
    return parse_task({"prompt": "p", **fields}, "t.jsonl:1")


@pytest.mark.parametrize(
    ("fields", "answer", "passed"),
    [
        ({"expected": "models", "scorer": "exact"}, " models\n", True),
        ({"expected": "models", "scorer": "exact"}, " models.Model", False),
        ({"expected": r"^\s*Http\w+", "scorer": "regex"}, " HttpResponse", True),
        ({"expected": r"^Http", "scorer": "regex"}, " HttpResponse", False),
        ({"expected": 3, "scorer": "json_field", "field": "a.b.1"}, '{"a": {"b": [1, 3]}}', True),
        ({"expected": "x", "scorer": "json_field", "field": "k"}, 'Sure: {"k": "x"} done', True),
        ({"expected": "x", "scorer": "json_field", "field": "k"}, '{"k": "y"}', False),
        ({"expected": "x", "scorer": "json_field", "field": "k"}, "no json here", False),
        ({"expected": "x", "scorer": "json_field", "field": "missing"}, '{"k": "x"}', False),
        ({"expected": 1234.5, "scorer": "numeric"}, "about 1,234.5 units", True),
        ({"expected": 10, "scorer": "numeric", "tolerance": 0.5}, "10.4)", True),
        ({"expected": 10, "scorer": "numeric", "tolerance": 0.5}, "11)", False),
        ({"expected": -2, "scorer": "numeric"}, "no number", False),
    ],
)
def test_scorers(fields: dict, answer: str, passed: bool) -> None:
    assert score(_task(**fields), answer)[0] is passed


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"expected": 1}, "exactly one of prompt and messages"),
        ({"prompt": "p", "messages": [], "expected": 1}, "exactly one of prompt and messages"),
        ({"prompt": "p"}, "expected is missing"),
        ({"prompt": "p", "expected": 1, "scorer": "fuzzy"}, "scorer must be one of"),
        ({"prompt": "p", "expected": "(", "scorer": "regex"}, "not a regular expression"),
        ({"prompt": "p", "expected": 1, "scorer": "json_field"}, "needs a field"),
        ({"prompt": "p", "expected": "ten", "scorer": "numeric"}, "needs a number"),
        ({"prompt": "p", "expected": 1, "answer": 1}, "unknown fields"),
        ({"prompt": "p", "expected": 1, "tolerance": [1]}, "tolerance must be a number"),
        ({"prompt": "p", "expected": 1, "tolerance": "abc"}, "tolerance must be a number"),
        ({"prompt": "p", "expected": 1, "temperature": None}, "temperature must be a number"),
        ({"prompt": "p", "expected": 1, "temperature": True}, "temperature must be a number"),
    ],
)
def test_bad_tasks_are_refused_naming_the_line(obj: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_task(obj, "t.jsonl:7")
    assert str(info.value).startswith("t.jsonl:7: ")


def test_a_task_file_that_can_not_be_read_is_refused_naming_it(tmp_path) -> None:
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\n")
    for path in (tmp_path / "missing.jsonl", tmp_path, binary):
        with pytest.raises(ValueError, match=f"^{path}: cannot read"):
            load_tasks(path)


def test_built_in_tasks_load() -> None:
    tasks = load_tasks(DEMO_TASKS)
    assert len(tasks) >= 8 and {t.scorer for t in tasks} >= {"exact", "regex", "numeric"}
    assert any(t.messages for t in tasks)
