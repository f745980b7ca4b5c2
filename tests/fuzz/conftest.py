"""Hypothesis keeps caches (source constants, charmaps) under ``./.hypothesis`` even with no example
database; schemathesis builds cases at collection, before any fixture runs. Point Hypothesis at a
temporary directory at import, removed at exit, so fuzzing leaves nothing in the checkout."""

from __future__ import annotations

import atexit
import shutil
import tempfile

from hypothesis.configuration import set_hypothesis_home_dir

_HOME = tempfile.mkdtemp(prefix="batchwire-hypothesis-")
set_hypothesis_home_dir(_HOME)
atexit.register(shutil.rmtree, _HOME, True)
