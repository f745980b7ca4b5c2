#!/usr/bin/env bash
# CPU per request with tracing off, old code against new, and with tracing on, alternating in one
# sitting: embedded, 2 sim workers (100 ms), 1,000 req/s. Figures: bench/results/tracing.md.
#   ./bench/tracing_ab.sh OLD_TREE [RUNS]    (OLD_TREE: a checkout of the code before tracing)
set -euo pipefail
NEW=$(cd "$(dirname "$0")/.." && pwd)
OLD=$(cd "${1:?usage: $0 OLD_TREE [RUNS]}" && pwd)
RUNS=${2:-3}
OUT="$NEW/bench/runs/tracing"
PY="$NEW/.venv/bin/python"
BENCH=(bench --client raw --check --start embedded --workers 2 --sim-latency-ms 100 --rate 1000
       --duration 10 --warmup 3 --lone 0)
mkdir -p "$OUT"

# The "on" runs export to a receiver that decodes every span, as a collector would.
URL_FILE=$(mktemp)
(cd "$NEW" && PYTHONPATH="$NEW" "$PY" -c '
import sys, time
from tests.support.otlp_receiver import OtlpReceiver
receiver = OtlpReceiver().start()
open(sys.argv[1], "w").write(receiver.url)
while True:
    time.sleep(3600)
' "$URL_FILE") &
RECEIVER=$!
trap 'kill $RECEIVER 2>/dev/null || true' EXIT
until [ -s "$URL_FILE" ]; do sleep 0.1; done

for run in $(seq "$RUNS"); do
  (cd "$OLD" && PYTHONPATH="$OLD" "$PY" -m batchwire.cli "${BENCH[@]}" --out "$OUT/off-old-run$run")
  (cd "$NEW" && PYTHONPATH="$NEW" "$PY" -m batchwire.cli "${BENCH[@]}" --out "$OUT/off-new-run$run")
  (cd "$NEW" && BATCHWIRE_OTLP_ENDPOINT=$(cat "$URL_FILE") PYTHONPATH="$NEW" "$PY" -m batchwire.cli "${BENCH[@]}" \
     --out "$OUT/on-new-run$run")
done

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/results.json")):
    rate = json.loads(path.read_text())["runs"][0]["rates"][0]
    cpu = rate["processes"]["batchwire"]["us_per_request"]
    lat = rate["latency_ms"]
    print(f"{path.parent.name:16} {cpu:7.1f} us/req  p50 {lat['p50']:.1f}  p99 {lat['p99']:.1f} ms  "
          f"errors {rate['error_total']}  answers/s {rate['throughput_rps']:.0f}")
PY
