#!/usr/bin/env bash
# Fetches, on a machine WITH network, what scripts/gpu_check.sh needs on a GPU machine WITHOUT one,
# into DIR (default: .gpu_deps in the repository root; ignored by git -- add it to
# .git/info/exclude -- and carried to the GPU machine with the working tree):
#
#   DIR/debs/    liburing-dev, liburing2 (io_uring: header + static liburing.a), libxxhash-dev
#                (xxhash.h), libb2-dev + libb2-1 (key digests: blake2.h + libb2.a), pkgconf-bin + libpkgconf3 (pkg-config, where the machine has none).
#                Debian packages, unpacked there with `dpkg -x` into a private prefix (never into /).
#   DIR/wheels/  libkvikio-cu<N> + kvikio-cu<N> (kvikio, C++ and Python), rapids-logger (libkvikio
#                needs it), cffi + pycparser (pykvtier's build), for CPython <PY> on manylinux x86_64.
#                nvidia-cufile, cuda-pathfinder, cupy, torch, pybind11, scikit-build-core, cmake are
#                expected on the GPU machine (the H200 image has them).
#
# Usage: bash scripts/gpu_deps.sh [DIR]    env: PYKVTIER_CUDA_MAJOR (13; 12 for a cu12 torch),
#        PYKVTIER_PY (3.12, the GPU image's python3), PYKVTIER_KVIKIO (26.10.0)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu_deps}
CUDA=${PYKVTIER_CUDA_MAJOR:-13}
PY=${PYKVTIER_PY:-3.12}
KVIKIO=${PYKVTIER_KVIKIO:-26.10.0}
mkdir -p "$DIR/debs" "$DIR/wheels"

echo "gpu_deps: Debian packages -> $DIR/debs"
(cd "$DIR/debs" && apt-get download liburing-dev liburing2 libxxhash-dev libb2-dev libb2-1 pkgconf-bin libpkgconf3) || {
  echo "gpu_deps: apt-get download failed; run 'apt-get update' first" >&2
  exit 1
}

echo "gpu_deps: wheels for CPython $PY, CUDA $CUDA -> $DIR/wheels"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64 any; do
  plat+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  "${plat[@]}" -d "$DIR/wheels" \
  "libkvikio-cu$CUDA==$KVIKIO" "kvikio-cu$CUDA==$KVIKIO" "rapids-logger==0.3.*" cffi pycparser
ls -la "$DIR/debs" "$DIR/wheels"
du -sh "$DIR"
