#!/usr/bin/env bash
# Multi-GPU runs, each part sized for one 10-minute device call:
#   split  (2 GPUs, issue 4): the 2-GPU GPU tests, then layer split vs one GPU on a Llama-3-8B shape
#   tp2    (2 GPUs, issue 5): tensor parallelism on the 70B-layer shape, 10,000-step memory run
#   tp4    (4 GPUs): TP over 4 GPUs with an uneven split
#   70b    (4 GPUs): a Llama-3-70B-shaped model with load_autosplit over 4 GPUs (fp16) and 2 GPUs (EXL2 4.0 bpw)
# Results land in $OUT (the device tool brings them back) and are then copied into benchmarks/results/.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m | tee -a "$OUT/gpus.txt"
case "${1:-split}" in
  split)
    CUDA_VISIBLE_DEVICES=0,1 timeout 150 python -m pytest -q -p no:cacheprovider tests/test_multi_gpu.py \
      tests/test_graphs.py 2>&1 | tail -15 | tee "$OUT/pytest_multi_gpu.txt"
    CUDA_VISIBLE_DEVICES=0,1 timeout 400 python benchmarks/multigpu_split.py --out "$OUT/multigpu_split.md" \
      --steps 128 --dir /tmp/llama3-8b-random
    ;;
  tp2)
    CUDA_VISIBLE_DEVICES=0,1 timeout 500 python benchmarks/tp.py --gpus 2 --timeout 480 --no-dist --no-diag \
      --mem-steps 10000 --out "$OUT/tp2.json"
    ;;
  tp4)
    timeout 500 python benchmarks/tp.py --gpus 4 --split 40,20,20,10 --mem-steps 1000 --timeout 480 --no-dist \
      --no-diag --out "$OUT/tp4.json"
    ;;
  70b)
    CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 400 python benchmarks/llama70b.py --format fp16 --out "$OUT/llama70b.md"
    CUDA_VISIBLE_DEVICES=0,1 timeout 150 python benchmarks/llama70b.py --format exl2 --out "$OUT/llama70b.md"
    ;;
esac
ls -la "$OUT"
