#!/usr/bin/env bash
# CPU per request against the floor, in one sitting: a bare FastAPI echo endpoint (`--start echo`),
# the same echo as a plain ASGI callable (`--start echo-asgi`: the HTTP server's share), the embedded
# service and the Kafka roles (2 sim workers of 100 ms), each at 1,000 req/s, the four alternated,
# three rounds by default. Prints each one's medians: µs per request of its processes
# (the Kafka roles together; Kafka and Redis apart), the ratio to the echo, and Redis commands.
# Usage: bench/cpu_floor.sh [rounds] [out dir]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
out=${2:-bench/runs/cpu-floor}
bw=.venv/bin/batchwire
mkdir -p "$out"
$bw stack up >/dev/null
for round in $(seq 1 "$rounds"); do
  for mode in echo echo-asgi embedded kafka; do
    echo "round $round: $mode" >&2
    $bw bench --start "$mode" --workers 2 --sim-latency-ms 100 --rate 1000 --duration 10 --warmup 3 \
      --client raw --lone 20 --seed "$round" --check --out "$out/$mode-$round" >"$out/$mode-$round.log" 2>&1 \
      || echo "  failed: see $out/$mode-$round.log" >&2
  done
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
figures = {}
for mode in ("echo", "echo-asgi", "embedded", "kafka"):
    rows = []
    for path in sorted(out.glob(f"{mode}-[0-9]*/results.json")):  # echo-[0-9]: not echo-asgi-N
        run = json.loads(path.read_text())["runs"][0]
        if not run["rates"] or not run["rates"][0]["latency_ms"]["count"]:  # it did not start, or nothing answered
            print(f"{path}: nothing measured, left out", file=sys.stderr)
            continue
        rate = run["rates"][0]
        groups = rate["processes"]
        roles = [g for k, g in groups.items() if k.startswith("batchwire.")] or [groups["batchwire"]]
        own = sum(g["us_per_request"] or 0 for g in roles)
        infra = sum(groups[k]["us_per_request"] or 0 for k in ("kafka", "redis") if k in groups)
        commands = (rate.get("redis_commands") or {}).get("per_request")
        lone = (run.get("lone") or {}).get("latency_ms", {}).get("p50")
        rows.append((own, infra, rate["latency_ms"]["p99"], commands, lone, rate["generator"]["cores"],
                     rate["lag_ms"].get("p99")))
    figures[mode] = [statistics.median([r[i] for r in rows if r[i] is not None] or [float("nan")]) for i in range(7)]
echo = figures["echo"][0]
print(f"{'':9} {'µs/req':>7} {'x echo':>7} {'kafka+redis':>12} {'p99 ms':>7} {'redis cmd/req':>14} {'lone p50':>9} {'gen cores':>9} {'lag p99':>8}")
for mode, (own, infra, p99, commands, lone, cores, lag) in figures.items():
    print(f"{mode:9} {own:7.0f} {own / echo:7.2f} {infra:12.0f} {p99:7.1f} {commands:14.2f} {lone:9.1f} {cores:9.2f} {lag:8.2f}")
PY
