"""The capacity commands as the CLI sees them: their parsers and handlers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from batchwire.capacity import plan, profile, simulate, validate


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``profile``, ``simulate``, ``plan`` and ``validate-sim``."""
    profile.add_parser(sub)
    simulate.add_parser(sub)
    plan.add_parser(sub)
    validate.add_parser(sub)


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "profile": profile.run,
    "simulate": simulate.run,
    "plan": plan.run,
    "validate-sim": validate.run,
}
