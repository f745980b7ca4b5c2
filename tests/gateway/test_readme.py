"""The error table in docs/operations.md is the gateway's ERROR_TABLE: same codes, statuses, words; and the
curl examples of the README's first screen and of docs/operations.md's cancellation answer as they show."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.errors import ERROR_TABLE
from tests.support.gateway_rig import Rig, RigFactory

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
README = OPERATIONS.parent.parent / "README.md"


def test_the_documented_error_table_matches_the_code() -> None:
    text = OPERATIONS.read_text()
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_0-9]+)` \| (\d{3}) \| (.+) \|$", section, flags=re.MULTILINE)
    documented = {code: (int(status), when) for code, status, when in rows}
    missing = sorted(set(ERROR_TABLE) - set(documented))
    extra = sorted(set(documented) - set(ERROR_TABLE))
    differ = sorted(code for code in set(documented) & set(ERROR_TABLE) if documented[code] != ERROR_TABLE[code])
    assert documented == ERROR_TABLE, f"docs/operations.md lacks {missing}, has extra {extra}, differs on {differ}"


def _curls(section: str) -> list[tuple[list[str], str | None]]:
    """Each curl command of ``section``'s sh blocks (as shlex words) with the ``# ...`` answer written under it."""
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()]
    found: list[tuple[list[str], str | None]] = []
    for index, line in enumerate(lines):
        if "curl " not in line:
            continue
        command = line.split("$(", 1)[-1].split("|", 1)[0].rstrip(")")
        following = lines[index + 1] if index + 1 < len(lines) else ""
        found.append(
            (shlex.split(command[command.index("curl ") :]), following[2:] if following.startswith("# ") else None)
        )
    return found


async def _send(rig: Rig, words: list[str], task_id: str | None) -> httpx.Response:
    """What ``curl`` with ``words`` asks of the gateway (the README's URLs name port 8000)."""
    method, headers, data, url = "GET", {}, None, ""
    pairs = iter(words[1:])
    for word in pairs:
        if word == "-X":
            method = next(pairs)
        elif word == "-H":
            name, _, value = next(pairs).partition(": ")
            headers[name] = value
        elif word == "-d":
            data, method = next(pairs), "POST" if method == "GET" else method
        elif not word.startswith("-"):
            url = word
    path = urlsplit(url.replace("$TASK", task_id or "")).path
    query = urlsplit(url).query
    return await rig.client.request(method, f"{path}?{query}" if query else path, headers=headers, content=data)


def _as_documented(answer: Any, documented: Any) -> bool:
    """``answer`` is what ``documented`` shows: ``"..."`` stands for any value, ``"text ..."`` for any text that
    starts so, and a figure with a fraction for any number (a latency)."""
    if documented == "...":
        return True
    if isinstance(documented, str) and documented.endswith(" ..."):
        return isinstance(answer, str) and answer.startswith(documented[:-3])
    if isinstance(documented, float):
        return isinstance(answer, (int, float))
    if isinstance(documented, dict):
        return (
            isinstance(answer, dict)
            and answer.keys() == documented.keys()
            and all(_as_documented(answer[key], value) for key, value in documented.items())
        )
    return bool(answer == documented)


async def _run_examples(rig: Rig, section: str) -> int:
    """Runs ``section``'s curl examples in order and checks each documented answer; returns how many it checked."""
    task_id, checked = None, 0
    for words, documented in _curls(section):
        response = await _send(rig, words, task_id)
        assert response.status_code in (200, 202), f"{shlex.join(words)}: {response.status_code} {response.text}"
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [line for line in response.text.splitlines() if line]
            if documented is not None:
                shown = documented.split(" / ")
                assert [line.split(":", 1)[0] for line in events] == [line.split(":", 1)[0] for line in shown]
                for line, shown_line in zip(events, shown, strict=True):
                    head, _, value = line.partition(": ")
                    shown_value = shown_line.partition(": ")[2]
                    parsed = (json.loads(value), json.loads(shown_value)) if head == "data" else (value, shown_value)
                    assert _as_documented(*parsed), f"{shlex.join(words)}: {line!r}, documented {shown_line!r}"
                checked += 1
            continue
        body = response.json()
        task_id = body.get("task_id", task_id)
        if documented is not None:
            assert _as_documented(body, json.loads(documented)), f"{shlex.join(words)}: {body}, documented {documented}"
            checked += 1
    return checked


async def test_the_readme_curl_examples_answer_as_documented(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.worker()
    first_screen = README.read_text().split("## Architecture")[0]

    assert await _run_examples(rig, first_screen) == 3


async def test_the_cancellation_example_answers_as_documented(make_rig: RigFactory) -> None:
    rig = await make_rig()  # no worker: the task waits, as behind a busy model's queue
    text = OPERATIONS.read_text()
    section = text.split("**Cancellation.**", 1)[1].split("\n**", 1)[0]

    assert await _run_examples(rig, section) == 1
