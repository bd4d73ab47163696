#!/usr/bin/env bash
# Sets up pykvtier on Debian/Ubuntu: system packages (liburing, xxHash, libb2, compilers, fio),
# then a virtual environment at .venv with pykvtier built and installed with its test extras, and
# vLLM, SGLang and LMCache (CPU, --no-deps, requirements-*.txt) for the integrations' tests.
# Idempotent; runs as root or through sudo. Usage: bash scripts/setup.sh [--editable]
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
PKGS=(liburing-dev libxxhash-dev libb2-dev pkg-config build-essential python3-dev python3-venv fio btrfs-progs)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "--editable" ]; then
  .venv/bin/python -m pip install -q scikit-build-core pybind11 cffi ninja
  .venv/bin/python -m pip install -q --no-build-isolation -e '.[test]'
else
  .venv/bin/python -m pip install -q '.[test]'
fi
# vLLM, for the vLLM plug-in's tests (tests/test_vllm.py) and bench/vs_vllm_fs.py: torch's CPU
# build first, with its deps; then vLLM and the packages its kv_offload modules import, without
# vLLM's own dependency tree (a CUDA torch and GPU kernels). Pins: requirements-vllm.txt.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q --no-deps -r requirements-vllm.txt
# SGLang, for the HiCache backend's tests (tests/test_sglang.py) and bench/vs_sglang_file.py:
# SGLang and what its mem_cache modules and cache controllers import, without its dependency
# tree (pins agree with vLLM's: one venv). Pins and the torchvision note: requirements-sglang.txt.
.venv/bin/python -m pip install -q --no-deps -r requirements-sglang.txt
# LMCache, for the storage plug-in's tests (tests/test_lmcache*.py) and bench/vs_lmcache_disk.py:
# LMCache 0.5.6 and what its storage_backend / cache_engine / distributed modules import, without
# its dependency tree (CUDA packages; pins agree with vLLM's and SGLang's: one venv).
.venv/bin/python -m pip install -q --no-deps -r requirements-lmcache.txt
# Check the installed package (from / so that the source tree does not shadow it).
venv_python="$PWD/.venv/bin/python"
(cd / && "$venv_python" -c "import pykvtier, pykvtier._native, pykvtier._uring; print('setup: pykvtier', pykvtier.__version__, 'ready in .venv')")
# vLLM logs warnings on import (no CUDA here): shown only if the import fails.
if ! vllm_check=$(cd / && "$venv_python" -c "import vllm, pykvtier.integrations.vllm; print('setup: vLLM', vllm.__version__, 'ready for pykvtier.integrations.vllm')" 2>&1); then
  echo "$vllm_check" >&2
  exit 1
fi
echo "$vllm_check" | tail -n 1
# SGLang's config modules import torchvision (CUDA-only on PyPI): the same placeholder the tests use.
tests_dir="$PWD/tests"
if ! sglang_check=$(cd / && "$venv_python" -c "import sys; sys.path.insert(0, '$tests_dir'); import sglang_torchvision_stub; sglang_torchvision_stub.install(); import sglang, sglang.srt.mem_cache.hicache_storage, pykvtier.integrations.sglang; print('setup: SGLang', sglang.__version__, 'ready for pykvtier.integrations.sglang')" 2>&1); then
  echo "$sglang_check" >&2
  exit 1
fi
echo "$sglang_check" | tail -n 1
# LMCache logs on import (no CUDA here): shown only if the import fails.
if ! lmcache_check=$(cd / && "$venv_python" -c "import lmcache.v1.storage_backend.abstract_backend, lmcache.v1.cache_engine, pykvtier.integrations.lmcache; from importlib.metadata import version; print('setup: LMCache', version('lmcache'), 'ready for pykvtier.integrations.lmcache')" 2>&1); then
  echo "$lmcache_check" >&2
  exit 1
fi
echo "$lmcache_check" | tail -n 1
