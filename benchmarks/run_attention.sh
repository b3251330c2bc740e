#!/usr/bin/env bash
# Attention kernels on one GPU: `bash benchmarks/run_attention.sh [PART ...]` (default: tests micro prefill qdecode).
#   tests    GPU tests of the flash / quantized-cache kernels and the routing (compiled kernels, real shapes)
#   micro    benchmarks/attention_micro.py: kernel TFLOP/s vs torch SDPA, decode over fp16/Q4/Q6/Q8/FP8 caches
#   sweep    benchmarks/flash_sweep.py: launch parameters by head_dim (not applied: paste the best into the tables)
#   prefill  benchmarks/prefill.py --skip-decode: 8B fp16 prefill 2k-64k (today, one forward, contiguous and paged
#            chunks) vs HF SDPA in the same run
#   qdecode  benchmarks/prefill.py --skip-prefill: batch-1 decode at 32k over fp16/Q4/Q6/Q8/FP8 caches
#   quick    all of the above in their --quick forms (a short sanity run)
# Results go to $OUT (default /tmp/exlpy-results).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
PARTS=${*:-tests micro prefill qdecode}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
for part in $PARTS; do
  echo "=== $part ($(date -u +%H:%M:%S))"
  case $part in
    tests)
      timeout 300 python -m pytest -q -x -p no:cacheprovider tests/test_attention_kernels_cuda.py 2>&1 | tail -15 \
        | tee "$OUT/pytest_attention_gpu.txt" ;;
    micro)
      timeout 400 python benchmarks/attention_micro.py --out "$OUT/attention_micro.md" 2>&1 | tail -40 ;;
    sweep)
      timeout 500 python benchmarks/flash_sweep.py --out "$OUT/flash_sweep.md" 2>&1 | tail -30 ;;
    prefill)
      timeout 590 python benchmarks/prefill.py --skip-decode --out "$OUT/prefill.md" 2>&1 | tail -30 ;;
    qdecode)
      timeout 400 python benchmarks/prefill.py --skip-prefill --out "$OUT/quant_decode.md" 2>&1 | tail -20 ;;
    quick)
      timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_attention_kernels_cuda.py \
        -k "2048 or short or graph" 2>&1 | tail -5
      timeout 150 python benchmarks/attention_micro.py --quick --out "$OUT/attention_micro_quick.md" 2>&1 | tail -20
      timeout 150 python benchmarks/flash_sweep.py --quick --out "$OUT/flash_sweep_quick.md" 2>&1 | tail -12
      timeout 300 python benchmarks/prefill.py --quick --out "$OUT/prefill_quick.md" 2>&1 | tail -20 ;;
    *) echo "unknown part $part" ;;
  esac
done
ls -la "$OUT"
