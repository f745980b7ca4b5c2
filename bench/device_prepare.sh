#!/usr/bin/env bash
# Packs what bench/device.sh needs on a lent GPU machine into .gpu/ (ignored by git): that machine
# has Python 3.12 with torch and transformers but no registry, so batchwire's other dependencies
# travel as wheels (the versions this .venv has), and MiniLM travels as a bf16 copy (what a GPU runs
# it in), its weights xz-compressed so that the working tree stays within the transfer limit.
set -euo pipefail
PY=.venv/bin/python
names=(fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection typing-extensions
  uvicorn httptools redis hiredis fastavro aiokafka async-timeout hdrhistogram pbr pytest-asyncio pytest-timeout
  opentelemetry-api)  # fastapi imports opentelemetry-api whether or not tracing is on
mkdir -p .gpu/whl .gpu/minilm
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
pins=()
for name in "${names[@]}"; do
  pins+=("$name==$($PY -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .gpu/whl "${pins[@]}"
minilm=$($PY -c 'from gpu_worker.backends.packaged import minilm_dir; print(minilm_dir())')
if [ ! -f .gpu/minilm/model.safetensors.xz ]; then
  find "$minilm" -maxdepth 1 -type f ! -name model.safetensors ! -name vocab.txt -exec cp {} .gpu/minilm/ \;
  cp -r "$minilm/1_Pooling" .gpu/minilm/
  $PY - "$minilm/model.safetensors" <<'PYEOF'
import lzma, sys, torch
from safetensors.torch import load_file, save
weights = load_file(sys.argv[1])
data = save({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, metadata={"format": "pt"})
with lzma.open(".gpu/minilm/model.safetensors.xz", "wb", preset=6) as out:
    out.write(data)
PYEOF
fi
du -sh .gpu
