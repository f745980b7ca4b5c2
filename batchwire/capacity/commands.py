"""The capacity commands as the CLI sees them: their parsers and handlers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from batchwire.capacity import simulate


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``simulate``."""
    simulate.add_parser(sub)


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": simulate.run,
}
