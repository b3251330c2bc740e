#!/usr/bin/env bash
# Final single-GPU checks: GPU tests, fp16/EXL2 logits vs references (real SmolLM2 included), SmolLM2 decode speed,
# the dynamic generator with 32 concurrent jobs. Expects the SmolLM2 EXL2 dir at /tmp/smol (reassembled from
# .gpu/p1..p3, carried in pieces) and the small shared models under .gpu/p3/models.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
M=.gpu/p3/models
timeout 120 python -m pytest -q -x -p no:cacheprovider tests/test_quant_kernels.py tests/test_kernels_triton.py \
  tests/test_graphs.py 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt"
timeout 90 python benchmarks/gpu_check.py --models $M/tiny-llama-fp16 $M/aidreams260K $M/stories260K \
  $M/tiny-llama-exl2-2.5 $M/tiny-llama-exl2-4.0 $M/tiny-llama-exl2-6.0 $M/tiny-llama-exl2-8.0 /tmp/smol \
  --out "$OUT/gpu_check.md"
timeout 60 python -m exlpy bench --model /tmp/smol --prompt-len 512 --gen-len 256 --prefill 0 2>&1 | tail -12 \
  | tee "$OUT/smol_bench.txt"
timeout 90 python benchmarks/dynamic_generator.py --model /tmp/smol --jobs 32 --out "$OUT/dynamic_smol_exl2.md"
timeout 90 python benchmarks/dynamic_generator.py --jobs 32 --out "$OUT/dynamic_smol_fp16.md"
ls -la "$OUT"
