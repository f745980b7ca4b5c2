"""What the tests share: polling, rigs and fixtures' plain helpers (no test module imports another)."""
