#!/usr/bin/env bash
# The README's test command as one pytest session on a GPU machine, and a block to paste into
# benchmarks/results/gpu_tests.md (date, device, versions, the summary line, what was skipped and why).
#
#   bash benchmarks/gpu_tests.sh            # from anywhere; ../shared beside the checkout for the data tests
#   bash benchmarks/gpu_tests.sh --quick    # only the GPU-relevant files (kernels, graphs, fusions, interpreter)
#   bash benchmarks/gpu_tests.sh -x -k exl2 # any other arguments go to pytest
#   GPU_TESTS_PASS=one bash benchmarks/gpu_tests.sh -n 28   # with -n: only the one-GPU pass (or "serial": only the
#                                           # multi-GPU / exclusive pass), for calls shorter than both passes
#
# TRITON_INTERPRET is unset: CUDA tests use compiled kernels, and tests/conftest.py runs the interpreter tests in
# a child pytest of their own. The checkout goes first on PYTHONPATH as an absolute path, so this exlpy is the one
# imported, installed or not, also by the tests' child processes whatever their cwd. Writes $OUT/gpu_tests.log and
# $OUT/gpu_tests.md (OUT defaults to /tmp/exlpy-results); exits with pytest's status.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/exlpy-results}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

ARGS=()
QUICK=""
for a in "$@"; do
  if [ "$a" = "--quick" ]; then QUICK=1; else ARGS+=("$a"); fi
done
FILES=()
if [ -n "$QUICK" ]; then
  FILES=(tests/test_kernels_triton.py tests/test_quant_kernels.py tests/test_decode_fusions.py
         tests/test_decode_fusions_model.py tests/test_graphs.py tests/test_bad_api.py)
fi

DEVICE=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
         | sed 's/, / /g' | paste -sd ';' -)
[ -n "$DEVICE" ] || DEVICE="no GPU visible (nvidia-smi failed)"
VERSIONS=$(python -c "
import torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = 'not installed'
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, {torch.cuda.device_count()} CUDA device(s)')
" 2>/dev/null)
START=$(date -u +"%Y-%m-%d %H:%M UTC")
T0=$(date +%s)

# With pytest-xdist (-n N) the multi-GPU tests run afterwards in one process of their own: N workers sharing
# two GPUs time-slice them, and the tensor-parallel collectives, which spin until the peer GPU arrives, then
# wait for other processes' time slices (tests that take seconds alone took minutes, 2026-11-26).
# The one-GPU pass spreads its workers over the GPUs (EXLPY_TEST_SPREAD_GPUS: see tests/conftest.py); tests that
# size a cache from the GPU's free memory (marker exclusive_gpu) run in the serial pass, where no worker shares it.
XDIST=""
for a in "${ARGS[@]+"${ARGS[@]}"}"; do case $a in -n|-n[0-9]*|--numprocesses*) XDIST=1 ;; esac; done
# GPU_TESTS_PASS=one|serial runs only that pass (default both): where a call's time limit is shorter than the two
# passes, they run as two calls on the same machine (the log of the second is appended to the first's).
PASS=${GPU_TESTS_PASS:-both}
if [ -n "$XDIST" ] && [ -z "$QUICK" ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  RC=0
  if [ "$PASS" != serial ]; then
    EXLPY_TEST_SPREAD_GPUS=$NGPU python -m pytest -q -p no:cacheprovider -rs -m "not multigpu and not exclusive_gpu" \
      --dist loadgroup "${ARGS[@]}" 2>&1 | tee "$OUT/gpu_tests.log"
    RC=${PIPESTATUS[0]}
  fi
  if [ "$PASS" != one ]; then
    # -v and a per-test timeout (SERIAL_ARGS): a hung collective names its test and the pass goes on.
    # shellcheck disable=SC2086  # SERIAL_ARGS is split into words on purpose
    python -m pytest -q -p no:cacheprovider -rs -m "multigpu or exclusive_gpu" \
      ${SERIAL_ARGS:--v --timeout=240 --timeout-method=signal} 2>&1 | tee -a "$OUT/gpu_tests.log"
    RC2=${PIPESTATUS[0]}
    [ "$RC2" = 5 ] || [ "$RC2" = 0 ] || RC=$RC2  # 5: none selected (fewer than two GPUs visible skip, not deselect)
  fi
else
  python -m pytest -q -p no:cacheprovider -rs "${ARGS[@]+"${ARGS[@]}"}" "${FILES[@]+"${FILES[@]}"}" 2>&1 \
    | tee "$OUT/gpu_tests.log"
  RC=${PIPESTATUS[0]}
fi
SECS=$(( $(date +%s) - T0 ))

SUMMARY=$(grep -E "[0-9]+ (passed|failed|error)" "$OUT/gpu_tests.log" | grep -E " in [0-9.]+s" | tail -2 \
          | sed -E 's/^=+ //; s/ =+$//' | paste -sd ';' -)  # two passes with -n: the rest; the multi-GPU tests
CUDA_SKIPS=$(grep -E "^SKIPPED" "$OUT/gpu_tests.log" | grep -i "cuda" \
             | sed -E 's/^SKIPPED \[([0-9]+)\].*/\1/' | awk '{n += $1} END {print n + 0}')
SKIPS=$(grep -E "^SKIPPED" "$OUT/gpu_tests.log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^:]+(:[0-9]+)?: /\1x /' \
        | sort | uniq -c | awk '{$1=""; print "  -" $0}' | head -20)
CMD="bash benchmarks/gpu_tests.sh${*:+ $*}"

{
  echo "## $START: ${DEVICE%%;*}"
  echo
  echo "- command: \`$CMD\` (python -m pytest -q, one session; interpreter tests in a child pytest)"
  echo "- device: $DEVICE"
  echo "- versions: $VERSIONS"
  echo "- summary: \`$SUMMARY\` (exit status $RC, ${SECS} s wall)"
  echo "- tests skipped for want of CUDA: $CUDA_SKIPS (0 expected on a GPU machine, bar multi-GPU tests with one GPU)"
  if [ -n "$SKIPS" ]; then
    echo "- skipped (count, reason):"
    echo "$SKIPS"
  fi
} > "$OUT/gpu_tests.md"

echo
echo "===== paste into benchmarks/results/gpu_tests.md ====="
cat "$OUT/gpu_tests.md"
exit "$RC"
