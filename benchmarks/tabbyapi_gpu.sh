#!/usr/bin/env bash
# TabbyAPI 79126f9 on exlpy on a GPU machine without network, in one device call:
#   bash benchmarks/tabbyapi_gpu.sh
# Carried (git-ignored) inputs: .tabby (the TabbyAPI checkout), .whl-tabby (wheels of what TabbyAPI needs and the
# GPU image lacks: see benchmarks/results/tabbyapi.md), .gpu/smoltok (SmolLM2's tokenizer files). Models: random
# SmolLM2-shaped fp16 and EXL2 4-bit (benchmarks/make_models.py) with SmolLM2's tokenizer; the results go to
# $OUT/tabbyapi.md, one section per model.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
for spec in fp16:0 exl2:4; do
  d=/tmp/smol${spec%%:*}
  if [ ! -f "$d/done" ]; then
    python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from make_models import write_model
write_model('$d', 'smollm2-135m', exl2_bits=${spec##*:})" && cp .gpu/smoltok/tokenizer* "$d/" && touch "$d/done"
  fi
  timeout "${TABBY_S:-270}" python3 benchmarks/tabbyapi.py --tabby .tabby --model "$d" --wheelhouse .whl-tabby \
    --venv /tmp/tabby-venv --out "$OUT/tabbyapi.md" 2>&1 | grep -E '^\[|results|pip failed|Error'
done
