#!/usr/bin/env bash
# Multi-GPU runs on a 4-GPU machine (nvidia-h200-x4), in two parts that each fit one 10-minute call.
#   part 1: layer split on 2 GPUs (issue 4) and tensor parallelism on 2 and 4 GPUs (issues 5, 7)
#   part 2: a Llama-3-70B-shaped model with load_autosplit over 4 GPUs (fp16) and 2 GPUs (EXL2 4.0 bpw)
# Results land in $OUT (the device tool brings them back) and are then copied into benchmarks/results/.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m | tee -a "$OUT/gpus.txt"
case "${1:-1}" in
  1)
    CUDA_VISIBLE_DEVICES=0,1 timeout 200 python benchmarks/multigpu_split.py --out "$OUT/multigpu_split.md" --steps 64 --dir /tmp/llama3-8b-random
    CUDA_VISIBLE_DEVICES=0,1 timeout 170 python benchmarks/tp.py --gpus 2 --timeout 160 --no-dist --out "$OUT/tp2.json"
    timeout 190 python benchmarks/tp.py --gpus 4 --split 40,20,20,10 --mem-steps 1000 --timeout 180 --no-dist --out "$OUT/tp4.json"
    ;;
  2)
    CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 400 python benchmarks/llama70b.py --format fp16 --out "$OUT/llama70b.md"
    CUDA_VISIBLE_DEVICES=0,1 timeout 150 python benchmarks/llama70b.py --format exl2 --out "$OUT/llama70b.md"
    ;;
esac
ls -la "$OUT"
