#!/bin/sh
# Installs batchwire from this checkout into the virtual environment VENV (made if missing), as a user
# installs it: a built wheel, not an editable install. The Dockerfile and the core-install smoke test
# (tests/smoke) both run this, so the image installs exactly what the test checks.
#
#   infra/install.sh VENV [EXTRAS]      e.g. infra/install.sh /opt/venv '[tracing]'
#
# BATCHWIRE_RESOLUTION=lowest-direct installs the lowest version pyproject.toml allows of each
# direct dependency, which is how the smoke test holds the declared floors true.
set -eu
venv=$1
extras=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
"$python" -m uv --version >/dev/null 2>&1 || "$python" -m pip install -q uv
"$python" -m uv venv -q --allow-existing --python "$python" "$venv"
# --reinstall/--refresh: uv would otherwise reuse a wheel it built from an older state of the checkout.
"$python" -m uv pip install -q --python "$venv/bin/python" --resolution "${BATCHWIRE_RESOLUTION:-highest}" \
    --reinstall-package batchwire --refresh-package batchwire "$root$extras"
