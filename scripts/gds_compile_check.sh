#!/usr/bin/env bash
# Compile check of the gds engine (pykvtier._gds) on a machine without kvikio's build setup or a
# GPU: compiles the gds target's sources, as CMakeLists.txt lists them, against the headers of
# pip wheels in a scratch virtual environment, prints every compiler command, and exits non-zero
# when a source does not compile.
#
#   python3 -m venv /tmp/gdsenv
#   /tmp/gdsenv/bin/pip install libkvikio-cu13 rapids-logger nvidia-cufile nvidia-cuda-runtime \
#       nvidia-cuda-nvcc nvidia-cuda-cccl pybind11        # (cu12: libkvikio-cu12, *-cu12 wheels)
#   bash scripts/gds_compile_check.sh /tmp/gdsenv [--link]
#
# Each C++ source is compiled twice, with PYKVTIER_DEVICE_VERIFY=1 and =0 (the two sides of its
# #if), the .cu source with the wheel's nvcc where there is one (skipped, and said, where not).
# --link also links the module (libkvikio, rapids_logger, static cudart) and imports it as
# pykvtier._gds with the repository's .venv python (its pykvtier._native must be built from the
# same tree; that python must be the venv's version): status(), refused arguments, an unlink job
# through the engine interface. That runs without a GPU (cudart loads the driver lazily).
# --tests instead builds the whole package with CMake (the venv's python, the wheels' toolkit as
# CUDAToolkit_ROOT; the venv needs cffi, numpy and pytest too) and runs tests/test_gpu_dispatch.py
# and tests/test_doctor.py against the built modules beside a copy of pykvtier/ (where the gds
# engine's own tests then run instead of skipping).
# Env: CXX (g++), OUT (a scratch folder; default a new temporary one), GDS_CMAKELISTS (read the
# gds target from another CMakeLists.txt), PYKVTIER_PYTHON (the python of --link's import),
# PYKVTIER_NATIVE (a pykvtier._native .so built elsewhere, e.g. a cmake build folder's, to import
# instead of the installed one; same pybind11 version as the venv's, whose types _gds shares).
set -uo pipefail

VENV=${1:?usage: gds_compile_check.sh VENV [--link | --tests]}
LINK=0
TESTS=0
[[ ${2:-} == --link ]] && LINK=1
[[ ${2:-} == --tests ]] && TESTS=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
CXX=${CXX:-g++}
PY="$VENV/bin/python"
[[ -x $PY ]] || { echo "gds_compile_check: $PY not found (VENV is a virtual environment's folder)" >&2; exit 2; }
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYINC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
EXT=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
OUT=${OUT:-$(mktemp -d /tmp/gds_compile_check.XXXXXX)}
mkdir -p "$OUT"

need() {  # need WHAT PATH...: the first existing PATH, else stop naming WHAT
  local what=$1
  shift
  for p in "$@"; do
    [[ -e $p ]] && { echo "$p"; return 0; }
  done
  echo "gds_compile_check: $what not found under $SP (looked for: $*)" >&2
  return 1
}
CUDA=$(dirname "$(need "cuda_runtime_api.h (nvidia-cuda-runtime wheel)" "$SP"/nvidia/cu*/include/cuda_runtime_api.h "$SP"/nvidia/cuda_runtime/include/cuda_runtime_api.h)")/.. || exit 2
CUFILE=$(dirname "$(need "cufile.h (nvidia-cufile wheel)" "$SP"/nvidia/cu*/include/cufile.h "$SP"/nvidia/cufile/include/cufile.h)") || exit 2
KVIKIO=$(need "kvikio's headers (libkvikio-cu13/-cu12 wheel)" "$SP/libkvikio/include") || exit 2
RLOG=$(need "rapids_logger's headers (rapids-logger wheel)" "$SP/rapids_logger/include") || exit 2
PYBIND=$("$PY" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null) ||
  { echo "gds_compile_check: pybind11 is not installed in $VENV" >&2; exit 2; }
CUDA=$(cd "$CUDA" && pwd)

# The gds targets' sources (with their set_source_files_properties flags) and include folders, as
# CMakeLists.txt has them, ${VAR}s expanded from every set() / list(APPEND) of VAR.
read -r -d '' CMAKE_READER <<'PYEOF'
import re, sys
text = re.sub(r"#[^\n]*", "", open(sys.argv[1]).read())
calls = [(m.group(1).lower(), m.group(2).split()) for m in re.finditer(r"(\w+)\s*\(([^()]*)\)", text)]
var = {}
for name, args in calls:
    if name == "set" and args:
        var.setdefault(args[0], []).extend(args[1:])
    elif name == "list" and len(args) > 1 and args[0] == "APPEND":
        var.setdefault(args[1], []).extend(args[2:])
def expand(items, depth=0):
    for it in items:
        m = re.fullmatch(r"\$\{(\w+)\}", it)
        if m and depth < 8:
            yield from expand(var.get(m.group(1), []), depth + 1)
        else:
            yield it.strip('"')
props = {}
for name, args in calls:
    if name == "set_source_files_properties" and "PROPERTIES" in args:
        i = args.index("PROPERTIES")
        kv = args[i + 1:]
        for f in args[:i]:
            for k, v in zip(kv[::2], kv[1::2]):
                v = v.strip('"')
                props.setdefault(f, []).append(v if k == "COMPILE_OPTIONS" else "-D" + v)
targets = {"_gds", "pykvtier_gds_verify"}
for name, args in calls:
    if name in ("pybind11_add_module", "add_library") and args and args[0] in targets:
        for f in expand(args[1:]):
            if f.startswith("csrc/"):
                print("SRC", f, *props.get(f, []))
    if name == "target_include_directories" and args and args[0] in targets:
        for d in expand(args[1:]):
            if d.startswith("csrc"):
                print("INC", d)
PYEOF
CMAKELISTS=${GDS_CMAKELISTS:-$REPO/CMakeLists.txt}
PARSED=$("$PY" -c "$CMAKE_READER" "$CMAKELISTS") || { echo "gds_compile_check: could not read $CMAKELISTS" >&2; exit 2; }
SOURCES=()
CU_SOURCES=()
INC_DIRS=()
declare -A SRC_FLAGS
while read -r kind path rest; do
  if [[ $kind == SRC && $path == *.cu ]]; then
    CU_SOURCES+=("$path")
  elif [[ $kind == SRC && -z ${SRC_FLAGS[$path]+x} ]]; then
    SOURCES+=("$path")
    SRC_FLAGS[$path]=$rest
  elif [[ $kind == INC && " ${INC_DIRS[*]} " != *" $path "* ]]; then
    INC_DIRS+=("$path")
  fi
done <<<"$PARSED"
((${#SOURCES[@]})) || { echo "gds_compile_check: no _gds sources found in $CMAKELISTS" >&2; exit 2; }

# gds_build_info.hpp, generated by CMakeLists.txt, as a build with kvikio has it.
mkdir -p "$OUT/generated"
cat > "$OUT/generated/gds_build_info.hpp" <<'EOF'
#pragma once
#define PYKVTIER_GDS_BUILT 1
#define PYKVTIER_GDS_DEVICE_VERIFY_BUILT 1
#define PYKVTIER_GDS_REASON "compile check"
#define PYKVTIER_GDS_KVIKIO_VERSION "0.0.0"
EOF

REPO_INC=()
for d in "${INC_DIRS[@]}"; do REPO_INC+=("-I$REPO/$d"); done
INC=("${REPO_INC[@]}" "-I$OUT/generated" "-I$PYBIND" "-I$PYINC" "-I$KVIKIO" "-I$RLOG" "-I$CUDA/include")
[[ $CUFILE -ef $CUDA/include ]] || INC+=("-I$CUFILE")
# (as CMakeLists.txt defines them for kvikio imported from its wheel layout)
DEFS=(-DKVIKIO_CUFILE_FOUND -DKVIKIO_CUFILE_VERSION_API_FOUND)
FLAGS=(-std=c++20 -fPIC -O2 -Wall -Wextra -fvisibility=hidden)

run() {
  echo "+ $*"
  "$@"
}

fail=0
objs=()
echo "gds_compile_check: sources ${SOURCES[*]} ${CU_SOURCES[*]}; headers of $SP"
for dv in 1 0; do
  for src in "${SOURCES[@]}"; do
    obj="$OUT/$(basename "${src%.*}").dv$dv.o"
    read -r -a extra <<<"${SRC_FLAGS[$src]}"
    if ! run "$CXX" "${FLAGS[@]}" "${extra[@]}" "${DEFS[@]}" -DPYKVTIER_DEVICE_VERIFY=$dv "${INC[@]}" -c "$REPO/$src" -o "$obj"; then
      echo "gds_compile_check: FAILED: $src (PYKVTIER_DEVICE_VERIFY=$dv)" >&2
      fail=1
    fi
    [[ $dv == 1 ]] && objs+=("$obj")
  done
done

NVCC=$CUDA/bin/nvcc
if ((${#CU_SOURCES[@]})); then
  if [[ -x $NVCC ]]; then
    for src in "${CU_SOURCES[@]}"; do
      obj="$OUT/$(basename "${src%.*}").cu.o"
      if ! run "$NVCC" -std=c++20 -Xcompiler -fPIC -O2 -gencode arch=compute_80,code=sm_80 \
          -gencode arch=compute_90,code=compute_90 "${REPO_INC[@]}" -c "$REPO/$src" -o "$obj"; then
        echo "gds_compile_check: FAILED: $src (nvcc)" >&2
        fail=1
      fi
      objs+=("$obj")
    done
  else
    echo "gds_compile_check: SKIPPED ${CU_SOURCES[*]}: no nvcc at $NVCC (pip install nvidia-cuda-nvcc)"
  fi
fi

if ((LINK && !fail)); then
  MOD="$OUT/mod/_gds$EXT"
  mkdir -p "$OUT/mod"
  if ! run "$CXX" -shared -o "$MOD" "${objs[@]}" -L"$SP/libkvikio/lib64" -lkvikio -L"$SP/rapids_logger/lib64" \
      -lrapids_logger "$CUDA/lib/libcudart_static.a" -lpthread -ldl -lrt \
      -Wl,-rpath,"$SP/libkvikio/lib64:$SP/rapids_logger/lib64"; then
    echo "gds_compile_check: FAILED: link" >&2
    fail=1
  else
    IPY=${PYKVTIER_PYTHON:-$REPO/.venv/bin/python}
    [[ -x $IPY ]] || IPY=$PY
    echo "+ $IPY (import $MOD as pykvtier._gds: status, refused arguments, an unlink job)"
    if ! "$IPY" -P - "$MOD" "$OUT" <<'EOF'; then
import errno, importlib.util, os, sys, types
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
if os.environ.get("PYKVTIER_NATIVE"):  # a _native built elsewhere, under a bare package
    pkg = types.ModuleType("pykvtier")
    pkg.__path__ = []
    sys.modules["pykvtier"] = pkg
    _native = load("pykvtier._native", os.environ["PYKVTIER_NATIVE"])
else:
    from pykvtier import _native
gds = load("pykvtier._gds", sys.argv[1])
st = gds.status()
print("status:", {k: st[k] for k in ("kvikio_version", "cuda_devices", "cufile_library", "compat_mode_default")})
for bad in (dict(checksum="fast"), dict(verify="header"), dict(compat="maybe"), dict(io_threads=0)):
    try:
        gds.GdsEngine(**bad)
    except ValueError as e:
        print("refused:", bad, "->", e)
    else:
        raise SystemExit(f"GdsEngine({bad}) was accepted")
eng = gds.GdsEngine(io_threads=2, compat="on", checksum="host")
assert (eng.name, eng.io_threads, eng.compat, eng.checksum, eng.verify) == ("gds", 2, "on", "host", "host")
f = os.path.join(sys.argv[2], "unlink-me")
open(f, "wb").close()
op = getattr(_native, "Op", None)
eng.submit(5, op.UNLINK if op else "unlink", [f, f + ".missing"])
eng.drain()
fin = eng.poll()
got = [(x[0], str(x[1]), list(x[2])) for x in fin]
print("poll:", got)
assert [(j, r) for j, _, r in got] == [(5, [0, -errno.ENOENT])], got
assert not os.path.exists(f)
for bad_op, entries, what in (("read_block", [(f, 4096, 4096, b"k" * 16)], "entry 0"), ("scan", [], "unknown op")):
    try:
        eng.submit(6, bad_op, entries)
    except ValueError as e:
        print("refused:", bad_op, "->", e)
        assert what in str(e), e
    else:
        raise SystemExit(f"submit({bad_op!r}) was accepted")
s = eng.stats()
print("stats:", s)
keys = getattr(_native, "STATS_KEYS", None)
assert keys is None or tuple(s) == tuple(keys), (tuple(s), keys)
assert (s["jobs_finished"], s["requests_ok"], s["requests_failed"]) == (1, 1, 1), s
assert eng.take_leftovers() == [] and eng.pending_jobs() == 0
eng.shutdown()
eng.shutdown()
EOF
      echo "gds_compile_check: FAILED: import / smoke run of the linked module" >&2
      fail=1
    fi
  fi
fi

if ((TESTS && !fail)); then
  run cmake -S "$REPO" -B "$OUT/build" -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
    -DCUDAToolkit_ROOT="$CUDA" >"$OUT/cmake.log" 2>&1 || { tail -20 "$OUT/cmake.log"; fail=1; }
  grep "pykvtier: gds engine" "$OUT/cmake.log"
  if ((!fail)) && ! run cmake --build "$OUT/build" -j"$(nproc)" >>"$OUT/cmake.log" 2>&1; then
    grep -B2 -A8 "error" "$OUT/cmake.log" | head -60
    fail=1
  fi
  if ((!fail)); then
    mkdir -p "$OUT/tree"
    cp -r "$REPO/pykvtier" "$REPO/tests" "$REPO/pyproject.toml" "$OUT/tree/"
    ln -sfn "$REPO/csrc" "$OUT/tree/csrc"
    cp "$OUT"/build/_*.so "$OUT/tree/pykvtier/"
    (cd "$OUT/tree" && run "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_dispatch.py tests/test_doctor.py) || fail=1
  fi
fi

if ((fail)); then
  echo "gds_compile_check: FAILED (objects in $OUT)"
  exit 1
fi
echo "gds_compile_check: OK (objects in $OUT)"
