"""Task files of `tokenmill eval tasks`: one JSON task per line, and the scorers of answers."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCORERS = ("exact", "regex", "json_field", "numeric")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
DEMO_TASKS = Path(__file__).resolve().parent / "demo_tasks.jsonl"
_KEYS = frozenset(
    {"id", "prompt", "messages", "expected", "scorer", "field", "tolerance", "max_tokens", "stop",
     "temperature"}
)  # fmt: skip


@dataclass(frozen=True)
class Task:
    """One prompt (text) or chat (messages), its expected answer and how to score it."""

    id: str
    expected: Any
    scorer: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    field: str | None = None  # json_field: a dotted path, e.g. "answer" or "items.0.name"
    tolerance: float = 0.0  # numeric: largest |answer - expected| that passes
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float = 0.0


def parse_task(obj: Any, where: str) -> Task:
    """A task from one decoded line; ValueError naming the line and the field otherwise."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a task is a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}; tasks take {sorted(_KEYS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"{where}: give exactly one of prompt and messages")
    if "expected" not in obj:
        raise ValueError(f"{where}: expected is missing")
    scorer = obj.get("scorer", "exact")
    if scorer not in SCORERS:
        raise ValueError(f"{where}: scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")
    if scorer == "json_field" and not isinstance(obj.get("field"), str):
        raise ValueError(f"{where}: the json_field scorer needs a field (a dotted path)")
    if scorer == "regex":
        try:
            re.compile(obj["expected"])
        except (re.error, TypeError) as exc:
            raise ValueError(f"{where}: expected is not a regular expression: {exc}") from None
    if scorer == "numeric" and not isinstance(obj["expected"], int | float):
        raise ValueError(f"{where}: the numeric scorer needs a number as expected")
    stop = obj.get("stop")
    for key in ("tolerance", "temperature"):
        value = obj.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return Task(
        id=str(obj.get("id", where)),
        expected=obj["expected"],
        scorer=scorer,
        prompt=obj.get("prompt"),
        messages=obj.get("messages"),
        field=obj.get("field"),
        tolerance=float(obj.get("tolerance", 0.0)),
        max_tokens=obj.get("max_tokens"),
        stop=[stop] if isinstance(stop, str) else stop,
        temperature=float(obj.get("temperature", 0.0)),
    )


def load_tasks(path: str | Path) -> list[Task]:
    """Every task of a JSONL file (blank lines skipped)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else f"not UTF-8 text ({exc.reason})"
        raise ValueError(f"{path}: cannot read: {why}") from None
    tasks = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON: {exc}") from None
        tasks.append(parse_task(obj, where))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def _json_value(answer: str) -> Any:
    """The answer as JSON: all of it, else the first object or array inside it."""
    text = answer.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        raise ValueError("the answer holds no JSON")
    return json.JSONDecoder().raw_decode(text[min(starts) :])[0]


def _field(value: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(value, list) and part.lstrip("-").isdigit():
            value = value[int(part)]
        elif isinstance(value, dict):
            value = value[part]
        else:
            raise KeyError(part)
    return value


def score(task: Task, answer: str) -> tuple[bool, str]:
    """(passed, what was compared) of one answer."""
    if task.scorer == "exact":
        got = answer.strip()
        return got == str(task.expected).strip(), f"answer {got!r}"
    if task.scorer == "regex":
        match = re.search(task.expected, answer)
        return match is not None, f"matched {match.group(0)!r}" if match else "no match"
    if task.scorer == "json_field":
        try:
            value = _field(_json_value(answer), task.field or "")
        except ValueError as exc:
            return False, f"not JSON: {exc}"
        except (KeyError, IndexError) as exc:
            return False, f"no field {task.field!r} ({exc!r})"
        return value == task.expected, f"{task.field} = {value!r}"
    found = NUMBER.search(answer)
    if found is None:
        return False, "no number in the answer"
    number = float(found.group(0).replace(",", ""))
    return abs(number - float(task.expected)) <= task.tolerance, f"number {number:g}"
