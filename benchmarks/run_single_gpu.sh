#!/usr/bin/env bash
# Single-GPU checks and timings in one go: `bash benchmarks/run_single_gpu.sh [PART ...]` (default: all).
#   setup   link .gpu/shared (a carried copy of the small files of ../shared) to ../shared
#   suite   the whole test suite in one session (CPU interpreter tests skip themselves here)
#   tests   GPU tests of the kernels, graphs and decode fusions
#   ab      benchmarks/decode.py on the code in .gpu/before (git archive of an older commit) and on this tree,
#           one after the other in one run: 8B fp16 b1, 8B EXL2 4.0 b1, prefill 2048, paged b32
#   check   fp16/EXL2 logits vs references on the small shared models (.gpu/p3/models) and, when reassembled
#           at /tmp/smol (from .gpu/p1..p3, carried in pieces), the real SmolLM2-135M EXL2 plus its decode speed
#   decode  benchmarks/decode.py: 8B fp16 and 8B EXL2 4.0 bpw decode, prefill 2048, paged b32, HF compile, profiles
#   gemv    benchmarks/quant_matmul.py decode-kernel checks and table
#   sweep   benchmarks/gemv_sweep.py: GEMV launch parameters timed in whole-model decode (8B fp16 and EXL2)
#   dyn     the dynamic generator with 32 concurrent jobs (SmolLM2 EXL2 and fp16)
#   grammar benchmarks/constrained_decode.py: single-stream decode with / without grammar constraints on the
#           SmolLM2 EXL2 at /tmp/smol (issue 15, target >= 90%); installs .gpu/wheels/llguidance-*.whl if carried
#   lora    LoRA: the GPU tests of adapters, then benchmarks/lora.py (adapter vs no adapter, 8B fp16 and EXL2)
# Results go to $OUT (default /tmp/exlpy-results).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
PARTS=${*:-tests check decode}
M=.gpu/p3/models
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -f .gpu/p3/smolpart2 ] && [ -f /tmp/smolpart0 ] && [ -f /tmp/smolpart1 ] && [ ! -d /tmp/smol ]; then
  mkdir -p /tmp/smol && cp .gpu/p3/smol/* /tmp/smol/
  cat /tmp/smolpart0 /tmp/smolpart1 .gpu/p3/smolpart2 > /tmp/smol/model.safetensors
fi
for part in $PARTS; do
  echo "=== $part ($(date -u +%H:%M:%S))"
  case $part in
    setup)
      [ -d ../shared ] || ln -s "$PWD/.gpu/shared" ../shared; ls ../shared ;;
    suite)
      timeout 400 python -m pytest -q -p no:cacheprovider tests 2>&1 | tail -15 | tee "$OUT/pytest_suite.txt" ;;
    ab)
      for tree in ${AB_ORDER:-before after}; do
        dir=.; [ "$tree" = before ] && dir=.gpu/before
        (cd $dir && PYTHONPATH=. timeout 200 python benchmarks/decode.py --models 8b,exl2 --hf '' \
          --work /tmp/exlpy_bench --out "$OUT/decode_$tree.md" 2>&1 | tail -12)
      done ;;
    tests)
      timeout 300 python -m pytest -q -x -p no:cacheprovider tests/test_quant_kernels.py tests/test_kernels_triton.py \
        tests/test_graphs.py tests/test_decode_fusions.py -k cuda 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt" ;;
    check)
      SMOL=""; [ -d /tmp/smol ] && SMOL=/tmp/smol
      timeout 150 python benchmarks/gpu_check.py --models $M/tiny-llama-fp16 $M/aidreams260K $M/stories260K \
        $M/tiny-llama-exl2-2.5 $M/tiny-llama-exl2-4.0 $M/tiny-llama-exl2-6.0 $M/tiny-llama-exl2-8.0 $SMOL \
        --out "$OUT/gpu_check.md" 2>&1 | tail -20
      if [ -n "$SMOL" ]; then
        timeout 90 python -m exlpy bench --model /tmp/smol --prompt-len 512 --gen-len 256 --prefill 0 2>&1 \
          | tail -12 | tee "$OUT/smol_bench.txt"
      fi ;;
    decode)
      timeout 420 python benchmarks/decode.py --models 8b,exl2 --hf compile --hf-timeout 200 --profile \
        --out "$OUT/decode.md" 2>&1 | tail -30 ;;
    grammar)
      python -c "import llguidance" 2>/dev/null || pip install -q --no-deps .gpu/wheels/llguidance-*.whl
      timeout 420 python -m benchmarks.constrained_decode --model /tmp/smol --out "$OUT/constrained_decode.md" 2>&1 \
        | tail -20
      timeout 300 python -m pytest -q -x -p no:cacheprovider tests/test_kernels_triton.py -k bitmask 2>&1 | tail -3 ;;
    gemv)
      timeout 300 python benchmarks/quant_matmul.py --quick-tune --skip-other-checks --out "$OUT/quant_matmul.md" \
        2>&1 | tail -30 ;;
    sweep)
      timeout 500 python benchmarks/gemv_sweep.py --out "$OUT/gemv_sweep.md" 2>&1 | tail -25 ;;
    dyn)
      timeout 90 python benchmarks/dynamic_generator.py --model /tmp/smol --jobs 32 --out "$OUT/dynamic_smol_exl2.md"
      timeout 90 python benchmarks/dynamic_generator.py --jobs 32 --out "$OUT/dynamic_smol_fp16.md" ;;
    lora)
      timeout 300 python -m pytest -q -p no:cacheprovider tests/test_lora_gpu.py tests/test_lora_kernels_triton.py \
        2>&1 | tail -5 | tee "$OUT/pytest_lora.txt"
      timeout 550 python benchmarks/lora.py --work /tmp/exlpy_bench --out "$OUT/lora.md" 2>&1 | tail -20 ;;
    *) echo "unknown part $part" ;;
  esac
done
ls -la "$OUT"
