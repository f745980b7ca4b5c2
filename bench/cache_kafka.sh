#!/usr/bin/env bash
# The collapsing and cache figure over Kafka, against a Kafka + Redis already running: a gateway, a
# batcher and 2 sim workers started here in a fresh namespace, the bench pointed at them.
# usage: KAFKA=HOST:PORT REDIS=redis://HOST:PORT/0 bench/cache_kafka.sh OUT_DIR RATE DURATION WARMUP
# The sharing flags come from the environment (BATCHWIRE_DETERMINISTIC_MODELS, BATCHWIRE_CACHE_TTL_S).
set -euo pipefail
cd "$(dirname "$0")/.."
export BATCHWIRE_KAFKA_BOOTSTRAP=${KAFKA:?Kafka bootstrap HOST:PORT} BATCHWIRE_REDIS_URL=${REDIS:?Redis URL}
out=$1 rate=$2 duration=$3 warmup=$4
ns="cache$(date +%s)"
mkdir -p "$out/logs"
B=.venv/bin/batchwire
pids=()
$B gateway --namespace "$ns" --port 18600 > "$out/logs/gateway.log" 2>&1 & pids+=($!)
$B batcher --namespace "$ns" --metrics-port 18601 > "$out/logs/batcher.log" 2>&1 & pids+=($!)
$B worker --namespace "$ns" --metrics-port 18602 --worker-id w0 > "$out/logs/w0.log" 2>&1 & pids+=($!)
$B worker --namespace "$ns" --metrics-port 18603 --worker-id w1 > "$out/logs/w1.log" 2>&1 & pids+=($!)
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait' EXIT
for _ in $(seq 1 120); do
  curl -sf http://127.0.0.1:18600/readyz > /dev/null && break
  sleep 0.5
done
$B bench --client raw --check --url http://127.0.0.1:18600/v1/inference \
  --metrics-url http://127.0.0.1:18600/metrics --metrics-url http://127.0.0.1:18601/metrics \
  --metrics-url http://127.0.0.1:18602/metrics --metrics-url http://127.0.0.1:18603/metrics \
  --zipf 1000:1.1 --lone 0 --concurrency-limit 20000 --rate "$rate" --duration "$duration" --warmup "$warmup" \
  --out "$out" | tail -n 4
