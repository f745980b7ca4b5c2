#!/usr/bin/env bash
# The batcher's named options, each off against the defaults, alternated in one sitting over Kafka
# (2 sim workers of 100 ms): light load (20 req/s: where the reserve, the kept credit and the spacing
# act) and 1,000 req/s (CPU per request and p99), plus 20 lone requests. Three rounds by default.
# Usage: bench/mechanisms_ab.sh [rounds] [out dir]; it prints each arm's medians at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
out=${2:-bench/runs/mechanisms}
bw=.venv/bin/batchwire
declare -A arms=(
  [default]=""
  [no-reserve]="BATCHWIRE_RESERVE_MS=0"
  [no-spacing]="BATCHWIRE_SPACING_MARGIN_MS=-1"
  [no-read-pacing]="BATCHWIRE_READ_PACE_MS=0"
  [no-kept-credit]="BATCHWIRE_KEEP_CREDIT_S=0"
)
order=(default no-reserve no-spacing no-read-pacing no-kept-credit)
mkdir -p "$out"
$bw stack up >/dev/null
for round in $(seq 1 "$rounds"); do
  for arm in "${order[@]}"; do
    echo "round $round: $arm" >&2
    env ${arms[$arm]} $bw bench --start kafka --workers 2 --sim-latency-ms 100 --rate 20,1000 \
      --duration 8 --warmup 2 --client raw --lone 20 --seed "$round" --check \
      --out "$out/$arm-$round" >"$out/$arm-$round.log" 2>&1 || echo "  failed: see $out/$arm-$round.log" >&2
  done
done
.venv/bin/python - "$out" "${order[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, arms = Path(sys.argv[1]), sys.argv[2:]
def med(values):
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else float("nan")
print(f"{'arm':16} {'20/s p50':>9} {'20/s p99':>9} {'1000/s p99':>11} {'roles us/req':>13} {'kafka+redis':>12} {'lone p50':>9}")
for arm in arms:
    rows = []
    for path in sorted(out.glob(f"{arm}-*/results.json")):
        run = json.loads(path.read_text())["runs"][0]
        if len(run["rates"]) != 2 or not all(rate["latency_ms"]["count"] for rate in run["rates"]):
            print(f"{path}: not both rates measured, left out", file=sys.stderr)  # it did not start, or stopped early
            continue
        low, high = run["rates"]
        roles = sum(g["us_per_request"] or 0 for k, g in high["processes"].items() if k.startswith("batchwire."))
        infra = sum(high["processes"][k]["us_per_request"] or 0 for k in ("kafka", "redis") if k in high["processes"])
        rows.append((low["latency_ms"]["p50"], low["latency_ms"]["p99"], high["latency_ms"]["p99"], roles, infra,
                     run.get("lone", {}).get("latency_ms", {}).get("p50")))
    cols = [med([r[i] for r in rows]) for i in range(6)]
    print(f"{arm:16} {cols[0]:9.1f} {cols[1]:9.1f} {cols[2]:11.1f} {cols[3]:13.0f} {cols[4]:12.0f} {cols[5]:9.1f}  ({len(rows)} runs)")
PY
