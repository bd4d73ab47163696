#!/usr/bin/env bash
# pykvtier's device check: build on a GPU machine, run the GPU tests, benchmark the load paths.
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Made to run blind, in one go, in under 6 minutes, on a single-GPU machine (an H200) that has
# no network: CUDA (nvcc, driver), PyTorch, CuPy, nvidia-cufile, cuda-pathfinder, pybind11,
# scikit-build-core, cmake and ninja are there; liburing, xxhash.h, kvikio and cffi may not be.
# Those come from a dependency folder carried along with the working tree:
#
#   PYKVTIER_GPU_DEPS (default: .gpu_deps in the repository root), made beforehand on a machine
#   with network by `bash scripts/gpu_deps.sh` (see its header):
#     debs/    liburing-dev + liburing2, libxxhash-dev, libb2-dev + libb2-1, pkgconf-bin + libpkgconf3: unpacked with
#              `dpkg -x` into a private prefix (never into /); pkg-config's .pc files are pointed
#              at it and PKG_CONFIG_PATH / CPATH / CMAKE_{INCLUDE,LIBRARY}_PATH set.
#     wheels/  libkvikio-cu13, kvikio-cu13, rapids-logger, cffi, pycparser (CPython 3.12):
#              `pip install --no-index --no-deps --target` into a private site folder on
#              PYTHONPATH, where pykvtier is installed too (built from this tree).
#   With the device tool: echo /.gpu_deps/ >> .git/info/exclude; bash scripts/gpu_deps.sh;
#   then run(command="bash scripts/gpu_check.sh $OUT", carry=[".gpu_deps"], timeout_s=420).
#
# Steps (each with its own time limit inside an overall budget, PYKVTIER_GPU_CHECK_BUDGET=340 s;
# a failed step is reported and the next ones still run where they can):
#   env     what the machine is: GPU, driver, python, torch, cmake, nvcc, kernel, disk
#   deps    liburing / xxhash / pkg-config from debs where the system lacks them; the wheels
#   build   pip install of this tree (CMake: _native, _uring, and _gds where kvikio is found, with
#           the device checksum kernel csrc/gds/gds_verify.cu where nvcc is: sm_80 + sm_90 + PTX, or
#           PYKVTIER_CUDA_ARCHS, e.g. "90"); nvcc is looked for on PATH, then in CUDACXX, then in
#           /usr/local/cuda{,-*}/bin (CUDACXX and CUDAToolkit_ROOT are set to it). On failure,
#           again without the kernel (PYKVTIER_DEVICE_VERIFY=OFF), then with PYKVTIER_GDS=OFF
#   doctor  `pykvtier doctor --root ROOT` (text and JSON)
#   tests   pytest: tests/test_gpu.py (marked gpu), test_gpu_dispatch.py, test_doctor.py,
#           test_engine.py, test_tier.py
#   bench   bench/gpu_paths.py: gds / gds-nover / kvikio-compat / bounce / host / kvikio-ref on
#           the same cold files (PYKVTIER_BENCH_BLOCKS x 2 MiB, default 512 = 1 GiB)
#
# OUTDIR receives (8 files at most): gpu_check.log (everything), summary.txt, build.log,
# doctor.txt, doctor.json, pytest.log, gpu_bench.json, gpu_bench.txt.
# Exit status: 0 when build and tests passed (the bench reports, it does not fail the check).
# Where: ROOT (block files) is PYKVTIER_GPU_ROOT, default /var/tmp/pykvtier-gpu-check (removed
# at the end); the build and site folders live under /tmp/pykvtier-gpu-check.
set -euo pipefail

OUT=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${PYKVTIER_GPU_CHECK_BUDGET:-340}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
DEPS=${PYKVTIER_GPU_DEPS:-$REPO/.gpu_deps}
WORK=/tmp/pykvtier-gpu-check
PREFIX=$WORK/prefix
SITE=$WORK/site
ROOT=${PYKVTIER_GPU_ROOT:-/var/tmp/pykvtier-gpu-check}
PY=${PYTHON:-python3}
export REPO OUT DEPS WORK PREFIX SITE ROOT PY
rm -rf "$WORK"
mkdir -p "$WORK" "$SITE" "$PREFIX" "$ROOT"
: >"$OUT/summary.txt"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
echo "gpu_check: repo $REPO, out $OUT, deps $DEPS, root $ROOT, budget ${BUDGET}s, $(date -u)"

FAILED=()
record() { printf '%-8s %-8s %5ss  %s\n' "$1" "$2" "$3" "${4:-}" | tee -a "$OUT/summary.txt"; }

# step NAME CAP_SECONDS FUNCTION: runs FUNCTION in a child bash under `timeout`, within the budget.
step() {
  local name=$1 cap=$2 fn=$3 left t0 rc
  left=$((DEADLINE - $(date +%s)))
  if ((left < 15)); then
    record "$name" skipped 0 "time budget spent"
    FAILED+=("$name")
    return 0
  fi
  ((cap > left)) && cap=$left
  echo
  echo "=================== $name (limit ${cap}s) ==================="
  t0=$(date +%s)
  set +e
  timeout --kill-after=10 "$cap" bash -c "set -euo pipefail; $(declare -f "$fn"); $fn"
  rc=$?
  set -e
  local secs=$(($(date +%s) - t0))
  if ((rc == 0)); then
    record "$name" ok "$secs"
  elif ((rc == 124 || rc == 137)); then
    record "$name" TIMEOUT "$secs" "after ${cap}s"
    FAILED+=("$name")
  else
    record "$name" FAILED "$secs" "exit $rc"
    FAILED+=("$name")
  fi
  return 0
}

# -------------------------------------------------------------------------------------- steps

do_env() {
  uname -a
  (nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv 2>&1 || echo "nvidia-smi: unavailable") | head -5
  "$PY" --version
  "$PY" - <<'EOF' || true
import importlib, sys
for m in ("torch", "cupy", "kvikio", "cffi", "pybind11", "scikit_build_core", "numpy", "pytest"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:18s} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{m:18s} missing ({type(exc).__name__})")
try:
    import torch
    print("torch.cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as exc:
    print("torch:", type(exc).__name__, exc)
EOF
  "$PY" -c "import os, sysconfig; h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); print('Python.h:', h if os.path.exists(h) else 'MISSING (the build needs the Python headers)')"
  cmake --version | head -1 || echo "cmake: missing"
  (command -v nvcc && nvcc --version | tail -2) || echo "nvcc: not on PATH"
  ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null || echo "nvcc: none in /usr/local/cuda*/bin"
  (pkg-config --modversion liburing 2>/dev/null && echo "liburing (system)") || echo "liburing: not on the system"
  df -h "$ROOT" /tmp | cat
  free -g | head -2
  ls /sys/module/nvidia_fs >/dev/null 2>&1 && echo "nvidia-fs: loaded" || echo "nvidia-fs: not loaded"
}

do_deps() {
  local need_debs=0
  if [ "${PYKVTIER_GPU_FORCE_DEBS:-0}" = 1 ] || ! pkg-config --exists liburing 2>/dev/null \
    || ! echo '#include <xxhash.h>' | cc -E - >/dev/null 2>&1 \
    || ! echo '#include <blake2.h>' | cc -E - >/dev/null 2>&1; then
    need_debs=1
  fi
  if ((need_debs)); then
    ls "$DEPS"/debs/*.deb >/dev/null 2>&1 || { echo "deps: no $DEPS/debs/*.deb (run scripts/gpu_deps.sh where there is network)"; exit 1; }
    for f in "$DEPS"/debs/*.deb; do
      dpkg -x "$f" "$PREFIX"
      echo "deps: unpacked $(basename "$f")"
    done
    for pc in $(find "$PREFIX" -name '*.pc'); do
      sed -i -e "s#^prefix=/usr#prefix=$PREFIX/usr#" -e "s#^libdir=/usr#libdir=$PREFIX/usr#" \
        -e "s#^includedir=/usr#includedir=$PREFIX/usr#" "$pc"
    done
    if [ -x "$PREFIX/usr/bin/pkgconf" ] && [ ! -e "$PREFIX/usr/bin/pkg-config" ]; then
      ln -s pkgconf "$PREFIX/usr/bin/pkg-config"
    fi
  else
    echo "deps: liburing, xxhash.h and libb2 from the system"
  fi
  echo "$need_debs" >"$WORK/need_debs"
  if ls "$DEPS"/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$DEPS"/wheels/*.whl
    echo "deps: wheels installed into $SITE: $(ls "$DEPS"/wheels | tr '\n' ' ')"
  else
    echo "deps: no $DEPS/wheels: kvikio (and cffi) only if the machine has them"
  fi
  "$PY" -c "import cffi, pycparser; print('deps: cffi', cffi.__version__)"
}

# The environment the build and the steps after it see (the unpacked debs, where used).
deps_env() {
  if [ "$(cat "$WORK/need_debs" 2>/dev/null || echo 0)" = 1 ]; then
    local lib=$PREFIX/usr/lib/x86_64-linux-gnu
    export PATH=$PREFIX/usr/bin:$PATH
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PKG_CONFIG_PATH=$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    export CPATH=$PREFIX/usr/include${CPATH:+:$CPATH}
    export CMAKE_INCLUDE_PATH=$PREFIX/usr/include
    export CMAKE_LIBRARY_PATH=$lib
  fi
}

# nvcc for the device checksum kernel: CMake looks only in CUDACXX, PATH and CUDA_PATH (and finds
# the toolkit, whose nvcc CMakeLists.txt then takes, in /usr/local/cuda); a toolkit elsewhere in
# /usr/local/cuda-X.Y is named here, nvcc and toolkit together.
cuda_env() {
  if [ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null 2>&1; then
    echo "build: nvcc ${CUDACXX:-$(command -v nvcc)}"
    return 0
  fi
  local c
  for c in /usr/local/cuda/bin/nvcc $(ls -d /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -V -r); do
    if [ -x "$c" ]; then
      export CUDACXX=$c
      CUDAToolkit_ROOT=$(dirname "$(dirname "$(readlink -f "$c")")")
      export CUDAToolkit_ROOT
      echo "build: nvcc not on PATH: CUDACXX=$CUDACXX, CUDAToolkit_ROOT=$CUDAToolkit_ROOT"
      return 0
    fi
  done
  echo "build: no nvcc found: the gds engine (if kvikio is found) verifies payloads on the host"
}

do_build() {
  deps_env
  cuda_env
  cd "$WORK"
  local args=(-m pip install --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" --upgrade
    -Cbuild-dir="$WORK/build" -Ccmake.define.CMAKE_BUILD_TYPE=Release -v "$REPO")
  if [ -n "${PYKVTIER_CUDA_ARCHS:-}" ]; then
    args+=(-Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$PYKVTIER_CUDA_ARCHS")
  fi
  if "$PY" "${args[@]}" >"$OUT/build.log" 2>&1; then
    echo "build: ok"
  else
    echo "build: FAILED; the end of build.log:"
    tail -40 "$OUT/build.log"
    echo "build: retrying without the device checksum kernel (PYKVTIER_DEVICE_VERIFY=OFF)"
    rm -rf "$WORK/build"
    if "$PY" "${args[@]}" -Ccmake.define.PYKVTIER_DEVICE_VERIFY=OFF >>"$OUT/build.log" 2>&1; then
      echo "build: ok without the device checksum kernel"
      grep -E "pykvtier: " "$OUT/build.log" | tail -3 | sed 's/^ */build: /' || true
      exit 3 # reported as a failed step: the kernel did not build
    fi
    tail -40 "$OUT/build.log"
    echo "build: retrying without the gds engine (PYKVTIER_GDS=OFF), so that the bounce path is still checked"
    rm -rf "$WORK/build"
    "$PY" "${args[@]}" -Ccmake.define.PYKVTIER_GDS=OFF >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    echo "build: ok without the gds engine"
    exit 3 # reported as a failed step: the gds engine did not build
  fi
  grep -E "pykvtier: |CUDA compiler identification" "$OUT/build.log" | sed 's/^ */build: /' || true
}

do_doctor() {
  deps_env
  cd "$WORK"
  "$PY" -c "import pykvtier, sys; print('pykvtier from', pykvtier.__file__); from pykvtier import _native; print(_native.gds_build_info())"
  "$PY" -m pykvtier.cli doctor --root "$ROOT" | tee "$OUT/doctor.txt"
  "$PY" -m pykvtier.cli doctor --root "$ROOT" --json >"$OUT/doctor.json"
}

do_tests() {
  deps_env
  cd "$WORK"
  export PYKVTIER_TEST_ROOT=$ROOT/tests
  mkdir -p "$PYKVTIER_TEST_ROOT"
  "$PY" -m pytest -q -rs -p no:cacheprovider --rootdir "$REPO" -o faulthandler_timeout=120 -m "not nvme" \
    "$REPO/tests/test_gpu.py" "$REPO/tests/test_gpu_dispatch.py" "$REPO/tests/test_doctor.py" \
    "$REPO/tests/test_engine.py" "$REPO/tests/test_tier.py" 2>&1 | tee "$OUT/pytest.log"
}

do_bench() {
  deps_env
  cd "$WORK"
  local fake=()
  "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || { fake=(--fake); echo "bench: no CUDA device: --fake run (numbers mean nothing)"; }
  "$PY" "$REPO/bench/gpu_paths.py" --root "$ROOT/bench" --out "$OUT" --blocks "${PYKVTIER_BENCH_BLOCKS:-512}" \
    --block-size 2M --batch 32 --rounds "${PYKVTIER_BENCH_ROUNDS:-3}" --threads 16 "${fake[@]}"
}

export -f deps_env cuda_env
step env 30 do_env
step deps 60 do_deps
step build 200 do_build
if [[ " ${FAILED[*]} " == *" build "* ]] && ! PYTHONPATH=$SITE "$PY" -c "import pykvtier._native" 2>/dev/null; then
  record doctor skipped 0 "no build"
  record tests skipped 0 "no build"
  record bench skipped 0 "no build"
else
  step doctor 45 do_doctor
  step tests 150 do_tests
  step bench 150 do_bench
fi
rm -rf "$ROOT"

echo
echo "=================== summary ($(($(date +%s) - START))s) ==================="
cat "$OUT/summary.txt"
[ -f "$OUT/gpu_bench.txt" ] && cat "$OUT/gpu_bench.txt"
grep -E "passed|failed|error" "$OUT/pytest.log" 2>/dev/null | tail -1 || true
if [[ " ${FAILED[*]} " == *" build "* || " ${FAILED[*]} " == *" tests "* ]]; then
  echo "gpu_check: FAILED (${FAILED[*]})"
  exit 1
fi
echo "gpu_check: ok${FAILED:+ (but: ${FAILED[*]})}"
