#!/usr/bin/env bash
# TabbyAPI 79126f9 on exlpy on a GPU machine without network, in one device call (under 7 minutes in all):
#   bash benchmarks/tabbyapi_gpu.sh
# Carried (git-ignored) inputs: .tabby (the TabbyAPI checkout), .whl-tabby (wheels of what TabbyAPI needs and the
# GPU image lacks: see benchmarks/results/tabbyapi.md), .gpu/smoltok (SmolLM2's tokenizer files). Models: random
# SmolLM2-shaped EXL2 4-bit and fp16 (benchmarks/make_models.py) with SmolLM2's tokenizer. Results: $OUT/tabbyapi.md
# (one section per model, rewritten after every check, so a run cut short keeps what it did), TabbyAPI's logs and
# the driver's output beside it. TABBY_TOTAL_S (default 400) is the whole script's budget: each run gets its
# share as `--budget` (55% of what is left for the first, which also installs and compiles; checks not started
# in time are recorded as skipped) and a `timeout` 25 s later.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/exlpy-results}
TOTAL=${TABBY_TOTAL_S:-400}
mkdir -p "$OUT"
for need in .tabby/main.py .whl-tabby .gpu/smoltok/tokenizer.json; do
  [ -e "$need" ] || { echo "missing $need: carry .tabby, .whl-tabby and .gpu/smoltok"; exit 2; }
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, importlib.metadata as m; print('torch', torch.__version__, m.version('torch'))"
runs=(exl2:4 fp16:0)
for i in "${!runs[@]}"; do
  spec=${runs[$i]}; kind=${spec%%:*}; d=/tmp/smol$kind
  if [ ! -f "$d/done" ]; then
    python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from make_models import write_model
write_model('$d', 'smollm2-135m', exl2_bits=${spec##*:})" && cp .gpu/smoltok/*.json "$d/" && touch "$d/done"
  fi
  [ -f "$d/done" ] || { echo "the $kind model could not be written"; continue; }
  # The first run also pays for pip and Triton's compiles: 55% of what is left; the last run gets the rest.
  left=$((TOTAL - SECONDS)); budget=$(( i + 1 < ${#runs[@]} ? left * 55 / 100 - 45 : left - 45 ))
  [ "$budget" -gt 60 ] || { echo "no time left for $kind ($left s)"; continue; }
  echo "== $kind model: budget $budget s (at $SECONDS s)"
  timeout -k 20 $((budget + 25)) python3 benchmarks/tabbyapi.py --tabby .tabby --model "$d" \
    --wheelhouse .whl-tabby --venv /tmp/tabby-venv --budget "$budget" --random-weights --port $((5057 + i)) \
    --out "$OUT/tabbyapi.md" --save-log "$OUT/tabby-$kind.log" > "$OUT/driver-$kind.txt" 2>&1
  rc=$?; echo "exit $rc at $SECONDS s"
  grep -E '^\[|^results|^setup: (torch|pip failed|set-up took)|Error|Traceback' "$OUT/driver-$kind.txt" | cut -c1-300
  [ "$rc" -eq 0 ] || tail -n 6 "$OUT/driver-$kind.txt" | cut -c1-300
done
grep -E '^\*\*|^## ' "$OUT/tabbyapi.md"
