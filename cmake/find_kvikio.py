"""Build helper (run by CMakeLists.txt): where pip-installed kvikio pieces live.

Prints ``KEY=VALUE`` lines: PREFIXES (the CMake package folders of the libkvikio and
rapids_logger wheels, ';'-separated), LIBDIRS (their library folders, for the module's RPATH), CUFILE_INCLUDE
(folders that hold cufile.h: the nvidia-cufile / nvidia-cufile-cu12 wheels) and CUFILE_LIB (their
libcufile.so.0, which kvikio's CMake package insists on seeing as CUDA::cuFile). Imports nothing
of those packages (no library is loaded); prints empty values where a piece is absent.
"""

from __future__ import annotations

import importlib.util
import os


def _package_dirs(name: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [p for p in (spec.submodule_search_locations or []) if os.path.isdir(p)]


def main() -> None:
    prefixes: list[str] = []
    libdirs: list[str] = []
    for pkg in ("libkvikio", "rapids_logger"):
        for d in _package_dirs(pkg):
            for lib in ("lib64", "lib"):
                if os.path.isdir(os.path.join(d, lib, "cmake")):
                    # The cmake folder itself: CMake then finds <it>/<name>/<name>-config.cmake
                    # (Debian's CMake does not search lib64/ under a plain prefix).
                    prefixes.append(os.path.join(d, lib, "cmake"))
                    libdirs.append(os.path.join(d, lib))
                    break
    cufile: list[str] = []
    cufile_libs: list[str] = []
    for d in _package_dirs("nvidia"):
        for sub in sorted(os.listdir(d)):
            inc = os.path.join(d, sub, "include")
            if os.path.isfile(os.path.join(inc, "cufile.h")):
                cufile.append(inc)
                for lib in ("lib", "lib64"):
                    so = os.path.join(d, sub, lib, "libcufile.so.0")
                    if os.path.isfile(so):
                        cufile_libs.append(so)
    print("PREFIXES=" + ";".join(prefixes))
    print("LIBDIRS=" + ";".join(libdirs))
    print("CUFILE_INCLUDE=" + ";".join(cufile))
    print("CUFILE_LIB=" + ";".join(cufile_libs))


if __name__ == "__main__":
    main()
