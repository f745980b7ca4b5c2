"""The capacity commands as the CLI sees them: their parsers and handlers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from batchwire.capacity import plan, simulate


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``simulate`` and ``plan``."""
    simulate.add_parser(sub)
    plan.add_parser(sub)


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": simulate.run,
    "plan": plan.run,
}
