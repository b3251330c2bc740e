#!/usr/bin/env bash
# Ray Serve on the GPU machine, whose image lacks it: its wheels (ray 2.60 is 76 MiB alone) exceed one call's
# 64 MiB carry, so they travel in parts over consecutive device calls on the same warm machine (it keeps /tmp
# between calls while held; it goes back after ~30 s idle, so issue the calls back to back).
#
# Here, once: `bash benchmarks/ray_parts.sh pack` downloads ray[serve]==2.60.0's wheels for CPython 3.12 (minus
# numpy, which the image has, and what .gpu/wheels carries), tars them and splits the tar into .gpu/ray/ parts of
# 60 MiB with its sha256. Then three device calls:
#   1. carry [".gpu/ray/raypack.tar.part00"]:  bash benchmarks/ray_parts.sh stash
#   2. carry [".gpu/ray/raypack.tar.part01", ".gpu/ray/raypack.sha256"]:  bash benchmarks/ray_parts.sh stash
#   3. carry [".gpu/wheels", ".gpu/shared"]:  bash benchmarks/ray_parts.sh install && bash benchmarks/gpu_session.sh ray
# `stash` copies the carried parts to /tmp/raypack; `install` joins them, checks the sha256 and installs the wheels
# with --no-deps into /tmp/site (what gpu_session.sh puts on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  pack)
    rm -rf /tmp/raydl /tmp/raysel && mkdir -p /tmp/raydl /tmp/raysel
    python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      "ray[serve]==2.60.0" -d /tmp/raydl
    have=$(ls .gpu/wheels | sed 's/-[0-9].*//' | tr 'A-Z_' 'a-z-')
    for f in /tmp/raydl/*.whl; do
      n=$(basename "$f" | sed 's/-[0-9].*//' | tr 'A-Z_' 'a-z-')
      if [ "$n" = numpy ] || grep -qx "$n" <<< "$have"; then continue; fi
      cp "$f" /tmp/raysel/
    done
    tar -cf /tmp/raypack.tar -C /tmp raysel
    rm -rf .gpu/ray && mkdir -p .gpu/ray
    split -b 60m -d /tmp/raypack.tar .gpu/ray/raypack.tar.part
    sha256sum /tmp/raypack.tar | cut -d' ' -f1 > .gpu/ray/raypack.sha256
    ls -la .gpu/ray ;;
  stash)
    mkdir -p /tmp/raypack && cp .gpu/ray/* /tmp/raypack/ && ls -la /tmp/raypack ;;
  install)
    cat /tmp/raypack/raypack.tar.part* > /tmp/raypack.tar
    [ "$(sha256sum /tmp/raypack.tar | cut -d' ' -f1)" = "$(cat /tmp/raypack/raypack.sha256)" ] \
      || { echo "raypack: sha256 mismatch (a part missing: was the machine released between calls?)" >&2; exit 1; }
    tar -xf /tmp/raypack.tar -C /tmp
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/raysel/*.whl .gpu/wheels/*.whl
    PYTHONPATH=/tmp/site python3 -c "import ray, ray.serve; print('ray', ray.__version__)" ;;
  *) echo "usage: $0 pack|stash|install" >&2; exit 2 ;;
esac
