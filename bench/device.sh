#!/usr/bin/env bash
# The hf backend on a GPU (issue 17), run on a lent device machine from the repository root after
# bench/device_prepare.sh has filled .gpu/ here (the call carries it):
#   device run: bash bench/device.sh            (carry: .gpu)
#   device run: bash bench/device.sh calls figure   (steps: tests, calls, figure; default all three)
# It installs the carried wheels beside the machine's torch and transformers, unpacks MiniLM, then
# runs the steps: the hf backend's tests on CUDA; bench/gpu_calls.py (one call's costs beyond its
# profile); `figures.sh validate-hf` on CUDA (VALIDATE_HF_MODELS picks the models). Everything it
# writes lands in $OUT (a tarball of bench/runs/validate-hf-cuda*, the logs).
set -uo pipefail
OUT=${OUT:-/tmp/device-out}
PY=${BATCHWIRE_PYTHON:-python3}
mkdir -p "$OUT"
if ! $PY -c 'import fastapi' 2>/dev/null; then  # the machine's image lacks batchwire's own dependencies
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
[ -f .gpu/minilm/model.safetensors ] ||
  $PY -c 'import lzma, shutil; shutil.copyfileobj(lzma.open(".gpu/minilm/model.safetensors.xz"), open(".gpu/minilm/model.safetensors", "wb"))'
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  $PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/machine.txt"
export PYTHONUNBUFFERED=1 BATCHWIRE_PYTHON=$PY BATCHWIRE_CMD="$PY -m batchwire.cli"
steps=${*:-tests calls figure}
if [[ " $steps " == *" tests "* ]]; then
  # The packaged-MiniLM test needs its package, which travels here as a bf16 copy instead.
  BATCHWIRE_TEST_DEVICE=cuda timeout "${DEVICE_TESTS_TIMEOUT:-120}" $PY -m pytest -q -p no:cacheprovider tests/backends \
    --deselect tests/backends/test_packaged.py::test_minilm_gives_the_published_similarities > "$OUT/tests-cuda.txt" 2>&1
  echo "tests on cuda: exit $? ($(tail -n 1 "$OUT/tests-cuda.txt"))"
fi
if [[ " $steps " == *" calls "* ]]; then  # one call's costs beyond its profile
  timeout 120 $PY bench/gpu_calls.py .gpu/minilm cuda > "$OUT/calls.json" 2> "$OUT/calls.err"
  head -c 3000 "$OUT/calls.json"
fi
if [[ " $steps " == *" figure "* ]]; then
  # Each sitting in a folder of its own beside the earlier ones (bench/runs/validate-hf-cuda/).
  VALIDATE_HF_OUT=${VALIDATE_HF_OUT:-bench/runs/validate-hf-cuda/sitting-$(date -u +%Y%m%d-%H%M)} \
    VALIDATE_HF_DEVICE=${VALIDATE_HF_DEVICE:-cuda} VALIDATE_HF_MINILM=.gpu/minilm VALIDATE_HF_MAX_RATE=${VALIDATE_HF_MAX_RATE:-2000} \
    VALIDATE_HF_SEEDS=${VALIDATE_HF_SEEDS:-1} \
    timeout "${DEVICE_FIGURE_TIMEOUT:-420}" ./bench/figures.sh validate-hf 2>&1 | tee "$OUT/validate-hf.txt"
  tar czf "$OUT/validate-hf.tgz" bench/runs/validate-hf-cuda 2>/dev/null
fi
ls -la "$OUT"
