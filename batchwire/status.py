"""``batchwire status``: the fleet as a table, read from any gateway's ``/v1/fleet``, and what its
``/readyz`` says is not served.

Every process of a deployment beats into the store, and every gateway serves what they said, so one
URL shows the whole fleet: embedded or over Kafka, whichever gateway it is. The standard library's
HTTP client is enough for one GET, and keeps this command in the core install.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from batchwire import flags

EXIT_UNSERVED = 1
"""A model the gateway serves has no live worker or no live batcher, or is stalled, or the gateway is not
ready (its bus or store down): requests wait or are refused."""
EXIT_UNREACHABLE = 2

MAX_WATCH_S = 86_400.0
"""The longest ``--watch`` period: a day, well within what ``time.sleep`` takes (an infinite one overflows)."""

_MEMBER_COLUMNS = (
    "ROLE",
    "ID",
    "MODELS",
    "STATE",
    "AGE",
    "REQ/S",
    "P50",
    "P99",
    "BATCH/S",
    "BATCH",
    "BUSY",
    "QUEUE",
    "HOST",
    "PID",
)
_MODEL_COLUMNS = (
    "MODEL",
    "BATCHERS",
    "WORKERS",
    "BUSY",
    "HUNG",
    "ANSWERED/S",
    "REFUSED/S",
    "P50",
    "P99",
    "QUEUE",
    "BATCH/S",
    "BATCH",
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``status``."""
    parser = sub.add_parser("status", help="the fleet: every gateway, batcher and worker, per model")
    flags.add(parser, "--url", "http://127.0.0.1:8000", str, "a gateway of the deployment")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("BATCHWIRE_API_KEY"),
        help="an operator key when the gateway has API keys [BATCHWIRE_API_KEY]",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (2 when given alone) until interrupted",
    )
    parser.add_argument("--json", action="store_true", help="the gateway's /v1/fleet document as it is")


def run(args: argparse.Namespace) -> int:
    """0 when every model has a live batcher and worker and the gateway is ready, 1 when not, 2 when the
    gateway cannot be read."""
    if args.watch is not None and not 0 < args.watch <= MAX_WATCH_S:
        print(
            f"batchwire status: --watch takes a number of seconds above 0 and at most {MAX_WATCH_S:g}, "
            f"got {args.watch:g}",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    code = EXIT_UNREACHABLE
    try:
        while True:
            code = _once(args.url, args.api_key, args.json, clear=args.watch is not None)
            if args.watch is None:
                return code
            time.sleep(args.watch)  # the refresh period a person asked for
    except KeyboardInterrupt:
        return code


def _once(url: str, api_key: str | None, as_json: bool, *, clear: bool) -> int:
    try:
        view = read_fleet(url, api_key)
    except FleetUnreadable as err:
        print(f"batchwire status: {err}", file=sys.stderr)
        if err.status != 503:
            return EXIT_UNREACHABLE
        # The gateway answered: the fleet lives in its store, which /readyz says is down (or not).
        down = not_ready(url)
        for line in down:
            print(f"batchwire status: {line}", file=sys.stderr)
        return EXIT_UNSERVED if down else EXIT_UNREACHABLE
    try:  # the document's members and rows, read before anything is printed
        text = None if as_json else render(view)
        unserved = bool(without_workers(view) or without_batchers(view))
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # another release's or service's fields
        print(
            f"batchwire status: cannot read the fleet from {url}: its members or models are not the fleet's "
            f"document ({type(err).__name__}: {err}); name a running gateway of this release with --url",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    readiness = not_ready(url)
    if clear:
        sys.stdout.write("\x1b[H\x1b[2J")
    if text is None:
        sys.stdout.write(json.dumps(view, indent=2) + "\n")
        for line in readiness:
            print(f"batchwire status: {line}", file=sys.stderr)
    else:
        sys.stdout.write(text + "".join(f"\n{line}\n" for line in readiness))
    sys.stdout.flush()
    return EXIT_UNSERVED if unserved or readiness else 0


class FleetUnreadable(Exception):
    """The gateway did not answer, or answered something other than its fleet (``status``: its HTTP status)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def read_fleet(url: str, api_key: str | None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The ``/v1/fleet`` document of the gateway at ``url``."""
    try:
        request = urllib.request.Request(url.rstrip("/") + "/v1/fleet", headers={"Accept": "application/json"})
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            doc = json.load(response)
        if not (isinstance(doc, dict) and isinstance(doc.get("members"), list) and isinstance(doc.get("models"), dict)):
            raise ValueError("the answer is not the fleet's document (an object with `members` and `models`)")
        return doc
    except urllib.error.HTTPError as err:
        fix = "; give an operator key with --api-key or BATCHWIRE_API_KEY" if err.code in (401, 403) else ""
        raise FleetUnreadable(f"{url} answered {err.code}: {_error_message(err)}{fix}", err.code) from err
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:  # HTTPException: cut short
        raise FleetUnreadable(
            f"cannot read the fleet from {url}: {err}; name a running gateway with --url or BATCHWIRE_URL"
        ) from err


def not_ready(url: str, timeout_s: float = 5.0) -> list[str]:
    """What the gateway's ``/readyz`` says is not served: the gateway itself when it is not ready (its bus or
    store down, every model stalled), and each stalled model. Every member may beat as idle meanwhile, as
    they beat into the store, not over the bus. ``/readyz`` needs no key; one that cannot be read says so."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/readyz", timeout=timeout_s) as response:
            doc = json.load(response)
    except urllib.error.HTTPError as err:
        try:
            doc = json.load(err)
        except (ValueError, OSError, http.client.HTTPException):
            return [f"the gateway is not ready: /readyz answered {err.code}"]
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
        return [f"the gateway's readiness cannot be read: {err}"]
    if not isinstance(doc, dict):
        return ["the gateway's readiness cannot be read: /readyz's answer is not an object"]
    lines = []
    error = doc.get("error")
    if isinstance(error, dict):
        message = str(error.get("message", ""))
        lines.append(f"the gateway is not ready: {message.removeprefix('not ready: ')}")
    models = doc.get("models")
    for model, state in sorted(models.items()) if isinstance(models, dict) else ():
        if state == "stalled":
            lines.append(
                f"model {model} is stalled: requests wait and no batch reaches its workers; its submits are refused"
            )
    return lines


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(err)["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError, http.client.HTTPException):
        return str(err.reason)


def without_workers(view: Mapping[str, Any]) -> list[str]:
    """The models with no live worker."""
    return [model for model, row in view.get("models", {}).items() if not row.get("workers_live")]


def without_batchers(view: Mapping[str, Any]) -> list[str]:
    """The models with no live batcher: their requests wait on the bus, unbatched, whatever the workers do.
    (A row without the count, from a gateway of an earlier release, is not judged.)"""
    return [model for model, row in view.get("models", {}).items() if row.get("batchers_live", 1) == 0]


def render(view: Mapping[str, Any]) -> str:
    """The members, then the models, as two aligned tables; models with no live batcher or worker named last."""
    members = [_member_row(member) for member in view.get("members", [])]
    models = [_model_row(model, row) for model, row in view.get("models", {}).items()]
    text = _table(_MEMBER_COLUMNS, members) + "\n" + _table(_MODEL_COLUMNS, models)
    unbatched = without_batchers(view)
    if unbatched:
        text += f"\nno live batcher for {', '.join(unbatched)}: its requests wait unbatched or are refused\n"
    missing = without_workers(view)
    if missing:
        text += f"\nno live worker for {', '.join(missing)}: its requests wait or are refused\n"
    ttls = {
        f"{member['role']} {member['id']} {member['result_ttl_s']:g} s": member["result_ttl_s"]
        for member in view.get("members", [])
        if member.get("result_ttl_s") and member.get("state") != "gone" and not member.get("final")
    }
    if len(set(ttls.values())) > 1:
        text += (
            f"\nlive processes keep task states for different times ({', '.join(sorted(ttls))}): results are kept "
            "the TTL of whichever wrote last; give every role the same --result-ttl-s\n"
        )
    for shared in view.get("shared_ids", []):
        text += (
            f"\n{len(shared['processes'])} live processes beat as {shared['role']} {shared['id']} "
            f"({', '.join(shared['processes'])}): give each its own --{shared['role']}-id, unless one has just "
            "restarted\n"
        )
    return text


def _member_row(member: Mapping[str, Any]) -> list[str]:
    figures = member.get("figures", {})
    return [
        member["role"],
        member["id"],
        ",".join(member.get("models", [])),
        member["state"],
        f"{member.get('age_s', 0):.1f}s",
        _num(figures.get("requests_per_s")),
        _num(figures.get("p50_ms"), 0),
        _num(figures.get("p99_ms"), 0),
        _num(figures.get("batches_per_s")),
        _num(figures.get("mean_batch_size")),
        _percent(figures.get("busy_fraction")),
        _num(figures.get("queue_depth"), 0),
        str(member.get("host", "")),
        str(member.get("pid", "")),
    ]


def _model_row(model: str, row: Mapping[str, Any]) -> list[str]:
    return [
        model,
        _count(row.get("batchers_live")),
        str(row.get("workers_live", 0)),
        str(row.get("workers_busy", 0)),
        str(row.get("workers_hung", 0)),
        _num(row.get("answered_per_s")),
        _num(row.get("refused_per_s")),
        _num(row.get("p50_ms"), 0),
        _num(row.get("p99_ms"), 0),
        _num(row.get("queue_depth"), 0),
        _num(row.get("batches_per_s")),
        _num(row.get("mean_batch_size")),
    ]


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(column), *(len(row[i]) for row in rows)]) for i, column in enumerate(columns)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [columns, *rows]
    ]
    return "\n".join(lines) + "\n"
