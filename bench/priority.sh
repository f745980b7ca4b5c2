#!/usr/bin/env bash
# Priority tiers and per-model admission (issue 18): the figures of bench/results/priority.md.
# Run from the repository root: ./bench/priority.sh <figure> ...; results land in bench/runs/priority/.
#
# Embedded figures start `batchwire up` themselves. Kafka figures start one gateway, one batcher and
# two sim workers per model against the Kafka and Redis named by KAFKA and REDIS (for a local stack:
# `batchwire stack up`, then KAFKA and REDIS from .batchwire/stack.env), in a fresh namespace.
#
# "scaled" figures use --max-batch 10: two sim workers (100 ms a call) then carry 200 req/s per model,
# so 3x capacity (600 req/s) is within what this machine's load generator offers. "full" figures use
# the default max batch of 100 (2,000 req/s per model); the generator reports what it could offer.
set -euo pipefail
BW=.venv/bin/batchwire
R=bench/runs/priority
COMMON=(--client raw --check --duration "${DURATION:-20}" --warmup 3 --pause 2 --lone 0 --concurrency-limit 20000)

embedded() {  # name, max batch, max queue depth, mixes...
  local name=$1 batch=$2 depth=$3
  shift 3
  echo "== $name"
  $BW bench "${COMMON[@]}" --start embedded --workers 2 --max-batch "$batch" \
    --sut-args "--max-queue-depth $depth" "$@" --out "$R/$name" --label "$name"
}

kafka() {  # name, max batch, max queue depth, models, mixes...
  local name=$1 batch=$2 depth=$3 models=$4 ns="prio$RANDOM" pids=() model index port status=0
  port=$(.venv/bin/python -c 'from batchwire.bench.sut import free_port; print(free_port())')
  shift 4
  echo "== $name (namespace $ns)"
  mkdir -p "$R/$name/logs"
  local role=(--kafka-bootstrap "$KAFKA" --redis-url "$REDIS" --namespace "$ns" --models "$models")
  for model in ${models//,/ }; do
    for index in 0 1; do
      $BW worker "${role[@]}" --model "$model" --max-batch "$batch" >"$R/$name/logs/worker-$model-$index.log" 2>&1 &
      pids+=($!)
    done
  done
  $BW batcher "${role[@]}" --max-batch "$batch" >"$R/$name/logs/batcher.log" 2>&1 &
  pids+=($!)
  $BW gateway "${role[@]}" --port "$port" --max-queue-depth "$depth" >"$R/$name/logs/gateway.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.5; done
  $BW bench "${COMMON[@]}" --url "http://127.0.0.1:$port/v1/inference" --pids "$(IFS=,; echo "${pids[*]}")" \
    "$@" --out "$R/$name" --label "$name" || status=$?
  kill "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  return "$status"
}

figure() {
  case $1 in
    # high at 10% of capacity alone, then beside low at 3x capacity
    tiers-embedded-scaled) embedded "$1" 10 400 --mix high:20 --mix high:20,low:600 ;;
    tiers-kafka-scaled) kafka "$1" 10 400 sim --mix high:20 --mix high:20,low:600 ;;
    tiers-embedded-full) embedded "$1" 100 4000 --mix high:200 --mix high:200,low:6000 ;;
    tiers-kafka-full) kafka "$1" 100 4000 sim --mix high:200 --mix high:200,low:6000 ;;
    # model b at 50% of its workers' capacity alone, then beside model a at 3x its own
    models-embedded-scaled) embedded "$1" 10 400 --mix b/normal:100 --mix a/normal:600,b/normal:100 ;;
    models-kafka-scaled) kafka "$1" 10 400 a,b --mix b/normal:100 --mix a/normal:600,b/normal:100 ;;
    *) echo "unknown figure $1" >&2; return 2 ;;
  esac
}

for name in "$@"; do figure "$name"; done
