#!/usr/bin/env bash
# Every published figure, one command each (issue 2 and 3). Run from the repository root on an
# otherwise idle machine: ./bench/figures.sh [figure ...]; results land in bench/runs/<figure>.
set -euo pipefail
BW=${BATCHWIRE_CMD:-.venv/bin/batchwire}  # bench/device.sh runs it as python3 -m batchwire.cli
PY=${BATCHWIRE_PYTHON:-.venv/bin/python}
B="$BW bench --client raw --check"
R=bench/runs
run() { local name=$1; shift; echo "== $name: $*"; $B "$@" --out "$R/$name" | tail -n 4; }

# A real model beside its simulation (issue 17): the hf backend, embedding with a tiny BERT built on
# the spot and with the packaged MiniLM, on CPU (VALIDATE_HF_DEVICE=cpu, the default) or on a GPU
# (cuda: bench/device.sh runs it there). Each model is profiled, then measured and simulated (its
# curve fed in) at 30% and 70% of one worker's capacity by that curve, capped at VALIDATE_HF_MAX_RATE
# (1,000 req/s): the tiny model's capacity is beyond what the embedded path carries. Bench starts
# `batchwire up`, which reads the backend from BATCHWIRE_* variables; no --check: embeddings are not
# the reversed input. --input-chars gives the profile's inputs as many tokens as the bench's random
# 32-character inputs (a byte per token for the tiny model; MiniLM's WordPiece splits them finer).
# Each rate runs once per seed (VALIDATE_HF_SEEDS, "1 2 3"; bench/device.sh runs one on a GPU).
# On a GPU the max batch is the mission's 100 for MiniLM and each curve is also profiled by length.
validate_hf() {
  local device=${VALIDATE_HF_DEVICE:-cpu} tiny=.batchwire/tiny-encoder minilm name path batch chars rates lone_ms
  local out="$R/validate-hf" table="bench/results/validate-hf.md" specs lengths=${VALIDATE_HF_LENGTHS:-none}
  if [ "$device" != cpu ]; then
    out="$R/validate-hf-$device" table="bench/results/validate-hf-$device.md" lengths=${VALIDATE_HF_LENGTHS:-auto}
  fi
  if [ -n "${VALIDATE_HF_OUT:-}" ]; then out=$VALIDATE_HF_OUT table=$VALIDATE_HF_OUT.md; fi  # a sitting of its own
  minilm=${VALIDATE_HF_MINILM:-$($PY -c 'from gpu_worker.backends.packaged import minilm_dir; print(minilm_dir())')}
  [ -d "$tiny" ] || $PY -c "from batchwire.bench.tiny_models import build_tiny_encoder as b; b('$tiny')"
  specs=("tiny:$tiny:8:32" "minilm:$minilm:32:160")
  [ "$device" = cpu ] || specs=("tiny:$tiny:32:32" "minilm:$minilm:100:160")
  mkdir -p "$(dirname "$table")"; : > "$table"
  for spec in "${specs[@]}"; do
    IFS=: read -r name path batch chars <<< "$spec"
    [[ " ${VALIDATE_HF_MODELS:-tiny minilm} " == *" $name "* ]] || continue
    echo "== validate-hf: $name on $device"
    rm -rf "${out:?}/$name"; mkdir -p "$out/$name"  # a new sitting: no earlier seed's run is read with it
    $BW profile --backend hf --model-path "$path" --hf-task embed --device "$device" --max-batch "$batch" \
      --input-chars "$chars" --lengths "$lengths" --repeats "${VALIDATE_HF_REPEATS:-20}" --out "$out/$name/curve.json"
    read -r rates lone_ms <<< "$($PY -c 'import sys; from batchwire.capacity.curve import load
c = load(sys.argv[1]); r = min(c.best_rate_per_worker()[0], float(sys.argv[2]))
print(f"{0.3 * r:.0f},{0.7 * r:.0f} {c.latency_ms(1):.1f}")' "$out/$name/curve.json" "${VALIDATE_HF_MAX_RATE:-1000}")"
    for seed in ${VALIDATE_HF_SEEDS:-1 2 3}; do
      BATCHWIRE_BACKEND=hf BATCHWIRE_MODEL_PATH="$path" BATCHWIRE_HF_TASK=embed BATCHWIRE_DEVICE="$device" \
        $BW bench --client raw --start embedded --workers 1 --max-batch "$batch" --rate "$rates" \
        --duration "${VALIDATE_HF_DURATION:-20}" --warmup 3 --label "hf embed $name on $device" --seed "$seed" \
        --backend-latency-ms "$lone_ms" --out "$out/$name/seed$seed" | tail -n 4
    done
    { echo "## $name: hf embed on $device, 1 worker, max batch $batch, curve $out/$name/curve.json"; echo
      $BW validate-sim "$out/$name" --curve "$out/$name/curve.json"; echo
    } >> "$table"
  done
}

figure() {
  case $1 in
    20rps) for i in 1 2 3; do
        run "20rps-embedded-run$i" --start embedded --workers 2 --rate 20 --duration 20 --warmup 3
        run "20rps-kafka-run$i" --start kafka --workers 2 --rate 20 --duration 20 --warmup 3
      done ;;
    load-embedded) run load-embedded --start embedded --workers 2 --rate 1000,1600 --duration 20 --warmup 3 ;;
    load-kafka) run load-kafka --start kafka --workers 2 --rate 1000,1600 --duration 20 --warmup 3 ;;
    # 95 % of capacity: a start-up backlog drains at the 5 % spare, so the warm-up is long enough for
    # it to clear before the window opens (batchwire.bench.settle notes a window that opens on one).
    1900-embedded) run 1900-embedded --start embedded --workers 2 --rate 1900 --duration 30 --warmup 15 \
        --concurrency-limit 20000 ;;
    1900-kafka) run 1900-kafka --start kafka --workers 2 --rate 1900 --duration 30 --warmup 15 \
        --concurrency-limit 20000 ;;
    policies) run policies --start embedded --workers 2 --policies work-conserving,classic \
        --rate 20,600,1600 --duration 15 --warmup 3 --concurrency-limit 20000 ;;
    slow-worker) run slow-worker --start kafka --workers 2 --slow-worker-latency-ms 500 \
        --rate 1200 --duration 20 --warmup 3 --concurrency-limit 20000 ;;
    # 80% of three workers' ceiling. L = 1 s keeps the offered load (240 req/s) within what this
    # 2-core machine's Kafka path carries; batch sizes depend on load per worker, not on L.
    batchers) for n in 1 2; do
        run "batchers-$n" --start kafka --batchers "$n" --workers 3 --sim-latency-ms 1000 \
          --rate 240 --duration 30 --warmup 5
      done ;;
    fast-backend) run fast-backend-embedded --start embedded --workers 4 --sim-latency-ms 5 \
        --rate 400,800,1200,1600,2000 --duration 10 --warmup 2
      run fast-backend-kafka --start kafka --workers 4 --sim-latency-ms 5 \
        --rate 200,400,600,800,1000 --duration 10 --warmup 2 ;;
    # 3x capacity (1 worker x 5 items per 100 ms call = 50/s), default gateway settings, 3 seeds per
    # mode; --timeout above the gateway's 30 s deadline so its 504s arrive and their tasks are read back.
    overload) for seed in 1 2 3; do
        for mode in embedded kafka; do
          run "overload-$mode/seed$seed" --start "$mode" --workers 1 --max-batch 5 --rate 150 --duration 30 \
            --warmup 3 --concurrency-limit 5000 --timeout 35 --seed "$seed"
        done
      done ;;
    # The cost of durability, interleaved in one sitting: RF 1 on one broker and one Redis, against
    # RF 3 (min ISR 2) on three brokers with a Redis replica and 3 Sentinels; each run on a fresh
    # stack of its own (--brokers), which it removes. Each run ends with the lone-request probe.
    durability) for i in 1 2 3; do
        run "durability-rf1/run$i" --start kafka --brokers 1 --workers 2 --rate 1000,1600 --duration 20 --warmup 3
        run "durability-rf3/run$i" --start kafka --brokers 3 --redis-replicas 1 --workers 2 --rate 1000,1600 \
          --duration 20 --warmup 3
      done ;;
    # RF 3 on three brokers with a lone Redis (no replica, no Sentinels): Kafka's share of durability.
    durability-kafka) for i in 1 2 3; do
        run "durability-rf3-kafka/run$i" --start kafka --brokers 3 --workers 2 --rate 1000,1600 --duration 20 --warmup 3
      done ;;
    # The simulation beside the measured runs (issue 17): 2 sim workers at 100 ms, embedded and
    # Kafka, 20 to 1,900 req/s, the slow worker and the classic policy, measured in one sitting into
    # results/validate/ (each run records its sends, which the simulation replays); the table in
    # validate.md.
    validate) (
      R=bench/runs/validate
      for f in 20rps load-embedded load-kafka 1900-embedded 1900-kafka policies slow-worker; do
        figure "$f"
      done
      for mode in embedded kafka; do
        run "600-$mode" --start "$mode" --workers 2 --rate 600 --duration 20 --warmup 3
      done
      for seed in 2 3; do  # 1,900 req/s over Kafka sits on a knife's edge: two more draws
        run "1900-kafka-seed$seed" --start kafka --workers 2 --rate 1900 --duration 30 --warmup 15 \
          --concurrency-limit 20000 --seed "$seed"
      done
      $BW validate-sim "$R"/20rps-*-run? "$R"/600-embedded "$R"/600-kafka "$R"/load-embedded \
        "$R"/load-kafka "$R"/1900-embedded "$R"/1900-kafka "$R"/1900-kafka-seed? "$R"/policies "$R"/slow-worker \
        --out bench/results/validate.md
    ) ;;
    validate-hf) validate_hf ;;
    # A rate predicted from two others, then measured (docs/capacity.md, "A rate held out";
    # bench/results/held-out.md): each of the three rates held out in turn.
    held-out)
      for mode in embedded kafka; do
        run "held-out-$mode" --start "$mode" --workers 2 --rate 300,800,1300 --duration 20 --warmup 3
        for rate in 300 800 1300; do $BW validate-sim "$R/held-out-$mode" --held-out "$rate" | tail -n 1; done
      done ;;
    # The token budget (issue 45; docs/performance.md): the packaged MiniLM embedding on CPU, one worker,
    # inputs of log-normal lengths (median 16 words of one token each, p99 256; MiniLM's 512 positions
    # take the longest, past its 256-token default), count-only batching against a budget of
    # TOKEN_BUDGET padded tokens in one run, each at the same rising rates.
    token-budget) local minilm
      minilm=$($PY -c 'from gpu_worker.backends.packaged import minilm_dir; print(minilm_dir())')
      BATCHWIRE_BACKEND=hf BATCHWIRE_HF_TASK=embed BATCHWIRE_MODEL_PATH="$minilm" BATCHWIRE_HF_MAX_INPUT_TOKENS=512 \
        $BW bench --client raw --start embedded --workers 1 --lengths 16:256 --budgets "0,${TOKEN_BUDGET:-2048}" \
        --rate "${TOKEN_BUDGET_RATES:-10,20,30,40,50}" --duration 20 --warmup 3 --lone 0 --warm 0 \
        --concurrency-limit 5000 --out "$R/token-budget" ;;
    # The same with a tiny BERT built on the spot (2 layers, width 32, byte tokens, 4,096 positions):
    # inputs of the same words are 5 to 6 tokens a word, and a budget of TOKEN_BUDGET_TINY bytes.
    token-budget-tiny) local tiny=.batchwire/tiny-encoder-4096
      [ -d "$tiny" ] || $PY -c "from batchwire.bench.tiny_models import build_tiny_encoder as b; b('$tiny', positions=4096)"
      BATCHWIRE_BACKEND=hf BATCHWIRE_HF_TASK=embed BATCHWIRE_MODEL_PATH="$tiny" \
        $BW bench --client raw --start embedded --workers 1 --lengths 16:256 --budgets "0,${TOKEN_BUDGET_TINY:-8192}" \
        --rate "${TOKEN_BUDGET_RATES:-20,40,80,120}" --duration 20 --warmup 3 --lone 0 --warm 0 \
        --concurrency-limit 5000 --out "$R/token-budget-tiny" ;;
    # Request collapsing and the result cache (issue 18; bench/results/cache.md): 10,000 requests
    # over 1,000 inputs of Zipf popularity (s = 1.1) at 1,600 req/s, with collapsing alone and with
    # the cache; then 3,000 req/s, past the 2,000/s GPU ceiling, with and without them.
    cache)
      local zipf=(--start embedded --workers 2 --zipf 1000:1.1 --lone 0 --concurrency-limit 20000)
      BATCHWIRE_DETERMINISTIC_MODELS=sim run cache-1600-collapse "${zipf[@]}" --rate 1600 --duration 6.25 --warmup 0
      BATCHWIRE_DETERMINISTIC_MODELS=sim BATCHWIRE_CACHE_TTL_S=300 \
        run cache-1600-on "${zipf[@]}" --rate 1600 --duration 6.25 --warmup 0
      for seed in 101 102 103; do
        BATCHWIRE_DETERMINISTIC_MODELS=sim BATCHWIRE_CACHE_TTL_S=300 \
          run "cache-3000-on-alone-seed$seed" "${zipf[@]}" --rate 3000 --duration 10 --warmup 3 --seed "$seed"
        run "cache-3000-off-alone-seed$seed" "${zipf[@]}" --rate 3000 --duration 10 --warmup 3 --seed "$seed"
      done ;;
    *) echo "unknown figure $1" >&2; exit 2 ;;
  esac
}

if [ $# -eq 0 ]; then
  set -- 20rps load-embedded load-kafka 1900-embedded 1900-kafka policies slow-worker batchers fast-backend overload \
    durability
fi
for f in "$@"; do figure "$f"; done
