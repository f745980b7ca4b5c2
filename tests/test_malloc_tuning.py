"""``keep_large_blocks_apart``: large blocks freed after a burst go back to the OS (glibc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_BURST = """
import sys
from batchwire.malloc_tuning import keep_large_blocks_apart

def rss_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

tuned = keep_large_blocks_apart() if sys.argv[1] == "tuned" else False
before = rss_kib()
kept = []
for _ in range(3):
    blocks = []
    for i in range(400):  # ~100 MiB of 256 KiB strings, each followed by a small block that stays
        blocks.append((f"{i:08d}" + "z" * 262_144)[::-1])
        kept.append(bytes(2048))
    del blocks
print(tuned, rss_kib() - before)
"""


def _burst(mode: str) -> tuple[bool, int]:
    done = subprocess.run([sys.executable, "-c", _BURST, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    tuned, grown_kib = done.stdout.split()
    return tuned == "True", int(grown_kib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's")
def test_memory_of_a_burst_of_large_strings_goes_back() -> None:
    tuned, grown_kib = _burst("tuned")
    assert tuned, "mallopt(M_MMAP_THRESHOLD) must be taken by glibc"
    assert grown_kib < 20 * 1024, f"RSS stayed {grown_kib} KiB above its start after the burst was freed"
