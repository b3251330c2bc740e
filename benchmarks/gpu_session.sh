#!/usr/bin/env bash
# One device call of the project's GPU checks: `bash benchmarks/gpu_session.sh PART [PART ...]`.
# Carried (git-ignored) inputs: .gpu/shared (small files of ../shared), .gpu/wheels (packages the GPU image lacks:
# fastapi/uvicorn/pydantic, openai, llguidance, jsonschema, lm-format-enforcer, formatron), .gpu/smoltok (SmolLM2's
# tokenizer and config, for a SmolLM2-shaped random EXL2 model). Parts:
#   suite        benchmarks/gpu_tests.sh: the whole test suite in one session (GPU_TEST_ARGS: more pytest arguments,
#                e.g. GPU_TEST_ARGS="-n 8" or GPU_TEST_ARGS="-x -k lora")
#   lora         benchmarks/lora.py (8B fp16 and EXL2, rank 16 on all seven projections)
#   prefill      benchmarks/prefill.py: prefill 2k/8k/32k vs HF SDPA, decode at 32k over fp16/Q4/Q6/Q8/FP8 caches
#   grammar      benchmarks/constrained_decode.py on a SmolLM2-shaped random EXL2 model with SmolLM2's tokenizer
#   serving      benchmarks/serving.py $SERVING_ARGS (default --models 8b: 8B fp16, generator and server parts)
#   spec         benchmarks/speculative.py --parts replay
#   convert      benchmarks/convert_8b.py (resumable; run again until it says finished)
#   mgpu         (2 GPUs) the multi-GPU tests: -m multigpu, tests/test_multi_gpu.py, tests/test_graphs.py, the TP
#                kernels' and pipeline's tests (host-memory all-reduce, embedding slice, prefill micro-batches, the
#                copy all-reduce of prefill messages)
#   tp2          (2 GPUs) benchmarks/tp.py: TP x2 on the 70B-layer shape vs one GPU (decode b1/b32, prefill 2048)
#   split        (2 GPUs) benchmarks/multigpu_split.py: 8B fp16 and EXL2 4-bit, layer split and autosplit vs one GPU
#   sampletop    benchmarks/sample_top_speed.py: the fused sampling kernels vs torch's sort, 128k vocabulary
#   stall        benchmarks/prefill_stall.py --model 8b: decode gaps next to a 16k prompt, captured vs eager chunks
#   vision       benchmarks/vision.py: Qwen2.5-VL-7B shape TTFT with a 1024x1024 image vs transformers, by phase
#   ray          (2 GPUs; needs Ray Serve importable) benchmarks/ray_serve.py --quick: 1 vs 2 one-GPU replicas, then
#                round-robin, power of two choices and prefix routing ($RAY_MODEL, default the tiny EXL2 model of
#                .gpu/shared)
#   ray8b        (2 GPUs; needs Ray Serve: benchmarks/ray_parts.sh carries it) the issue's figures, ~5 minutes:
#                benchmarks/ray_serve.py --model 8b --preset 8b (a random-weight 8B fp16 model, built under
#                /tmp/exlpy_bench unless an earlier call did): 1 vs 2 one-GPU replicas under 128 streams, then
#                round-robin, power of two choices and prefix routing with 2,000-token system prompts; the full
#                log in $OUT/ray8b.log
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
# Absolute: child processes (tests that spawn Python, benchmarks' workers) import this exlpy whatever their cwd.
export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
[ -d ../shared ] || ln -s "$ROOT/.gpu/shared" ../shared
if [ -d .gpu/wheels ] && ! python3 -c "import fastapi, llguidance" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$ROOT:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for part in "$@"; do
  echo "=== $part ($(date -u +%H:%M:%S))"
  case $part in
    # shellcheck disable=SC2086  # GPU_TEST_ARGS is split into words on purpose
    suite) OUT=$OUT timeout "${SUITE_S:-280}" bash benchmarks/gpu_tests.sh ${GPU_TEST_ARGS:-} 2>&1 | tail -25 ;;
    lora) timeout "${LORA_S:-280}" python benchmarks/lora.py --out "$OUT/lora.md" 2>&1 | tail -25 ;;
    prefill) timeout "${PREFILL_S:-330}" python benchmarks/prefill.py --lengths 2048,8192,32768 \
               --out "$OUT/prefill.md" 2>&1 | tail -25 ;;
    grammar)
      if [ ! -f /tmp/smolrand/done ]; then
        python -c "
import sys; sys.path.insert(0, 'benchmarks')
from make_models import write_model
write_model('/tmp/smolrand', 'smollm2-135m', exl2_bits=4)" && cp .gpu/smoltok/tokenizer* /tmp/smolrand/ && touch /tmp/smolrand/done
      fi
      timeout "${GRAMMAR_S:-150}" python -m benchmarks.constrained_decode --model /tmp/smolrand \
        --out "$OUT/constrained_decode.md" 2>&1 | tail -20 ;;
    serving) timeout "${SERVING_S:-400}" python benchmarks/serving.py ${SERVING_ARGS:---models 8b} \
               --out "$OUT/serving.md" 2>&1 | tail -30 ;;
    spec) timeout "${SPEC_S:-300}" python benchmarks/speculative.py --parts replay --out "$OUT/speculative.md" \
            2>&1 | tail -30 ;;
    convert) timeout "${CONVERT_S:-560}" python benchmarks/convert_8b.py --work /tmp/cv8b --budget "${CONVERT_BUDGET:-540}" \
               --out "$OUT/convert.md" 2>&1 | tail -25 ;;
    ray) timeout "${RAY_S:-235}" python benchmarks/ray_serve.py --model "${RAY_MODEL:-../shared/models/tiny-llama-exl2-4.0}" \
           --quick --out "$OUT/ray_serve.md" 2>&1 | grep -v "^(\|INFO\|WARNING" | tail -30 ;;
    ray8b) timeout "${RAY8B_S:-520}" python benchmarks/ray_serve.py --model 8b --work /tmp/exlpy_bench --preset 8b \
             --out "$OUT/ray_serve.md" 2>&1 | tee "$OUT/ray8b.log" | grep -av -E $'^(\e\\[[0-9;]*m)?\\(|INFO|WARNING' \
             | tail -60 ;;  # Ray's worker lines (colour code, then "(Actor pid=...)") stay in the log
    mgpu) timeout "${MGPU_S:-300}" python -m pytest -q -p no:cacheprovider -rfEs --timeout=120 \
            --timeout-method=thread ${MGPU_ARGS:-} \
            tests/test_multigpu_paths.py tests/test_multi_gpu.py tests/test_graphs.py \
            tests/test_tp_pipeline.py::test_pipelined_prefill_two_gpus \
            tests/test_tp_copy.py::test_copy_sum_two_gpus tests/test_tp_copy.py::test_copy_prefill_two_gpus \
            tests/test_host_allreduce.py::test_two_streams_equal_reference \
            tests/test_host_allreduce.py::test_fused_norm_two_streams \
            tests/test_embed_slice.py::test_kernel_equals_reference_cuda 2>&1 | tee "$OUT/mgpu.log" \
            | grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" | cut -c1-400 | tail -40 ;;
    tp2) CUDA_VISIBLE_DEVICES=0,1 timeout "${TP_S:-330}" python benchmarks/tp.py --gpus 2 --timeout "${TP_WD:-320}" \
           --no-dist --no-diag --mem-steps "${TP_MEM:-0}" --steps "${TP_STEPS:-200}" ${TP_ARGS:-} --out "$OUT/tp2.json" 2>&1 \
           | grep -v '^{' | tail -30; python -c "import json; r = json.load(open('$OUT/tp2.json')); \
print(json.dumps({k: v for k, v in r.items() if k != 'flops'}, indent=0)[:3000])" ;;
    split) timeout "${SPLIT_S:-300}" python benchmarks/multigpu_split.py --out "$OUT/split_fp16.md" --steps 128 \
             --dir /tmp/llama3-8b-random 2>&1 | tail -12
           timeout "${SPLIT_S:-300}" python benchmarks/multigpu_split.py --exl2 4 --split-gb 2.5 \
             --out "$OUT/split_exl2.md" --steps 128 --dir /tmp/llama3-8b-exl2 2>&1 | tail -12 ;;
    sampletop) timeout "${SAMPLETOP_S:-90}" python benchmarks/sample_top_speed.py 2>&1 | tee "$OUT/sample_top.txt" | tail -20 ;;
    stall) timeout "${STALL_S:-200}" python benchmarks/prefill_stall.py --model 8b 2>&1 | tee "$OUT/prefill_stall.txt" \
             | tail -25 ;;
    vision) timeout "${VISION_S:-150}" python benchmarks/vision.py --out "$OUT/vision.md" 2>&1 | tail -40 ;;
    *) echo "unknown part $part" ;;
  esac
done
ls -la "$OUT"
