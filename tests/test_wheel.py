"""CMake names what a build is missing: the package (apt and dnf names) and the minimum version.

Each test configures the real CMakeLists.txt in a temporary build folder with one requirement
made invisible the way CMake and pkg-config themselves allow (PKG_CONFIG_LIBDIR, CMAKE_IGNORE_PATH,
CMAKE_DISABLE_FIND_PACKAGE_<name>, a preset cache path, CXX), and checks the error it stops with.
The wheel itself (scripts/build_wheel.sh) is built, installed and run by .ci/run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CMAKE = shutil.which("cmake")

pytestmark = pytest.mark.skipif(CMAKE is None, reason="cmake is not installed")


def _pybind11_dir() -> str:
    pybind11 = pytest.importorskip("pybind11", reason="pybind11 (a build requirement) is not installed")
    return pybind11.get_cmake_dir()


@pytest.fixture
def configure(tmp_path):
    """configure(*cmake_args, env=..., pybind11=True): runs CMake's configure of the repository
    in a fresh build folder (in memory where /dev/shm is: a configure is many small files)."""
    if os.access("/dev/shm", os.W_OK):
        build = tempfile.mkdtemp(prefix="pykvtier-cmake-", dir="/dev/shm")
    else:
        build = str(tmp_path / "build")

    def run(*args: str, env: dict[str, str] | None = None,
            pybind11: bool = True) -> subprocess.CompletedProcess:
        cmd = [CMAKE, "-S", REPO, "-B", build, f"-DPython_EXECUTABLE={sys.executable}",
               "-DPYKVTIER_GDS=OFF", *args]
        if pybind11:
            cmd.append(f"-Dpybind11_DIR={_pybind11_dir()}")
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR")}
        full_env.update(env or {})
        return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=tmp_path,
                              timeout=300)

    yield run
    shutil.rmtree(build, ignore_errors=True)


def error_text(proc: subprocess.CompletedProcess) -> str:
    """The configure's error, its lines re-joined (CMake wraps messages at 80 columns)."""
    assert proc.returncode != 0, proc.stdout[-3000:]
    return " ".join(proc.stderr.split())


def test_configure_succeeds_here(configure, tmp_path):
    """The control: the same command with nothing hidden configures."""
    proc = configure()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pykvtier: xxHash " in proc.stdout


def test_missing_liburing_names_its_packages_and_minimum(configure, tmp_path):
    (tmp_path / "pc").mkdir()
    err = error_text(configure(env={"PKG_CONFIG_LIBDIR": str(tmp_path / "pc")}))
    assert "liburing >= 2.3 not found by pkg-config" in err
    assert "apt-get install liburing-dev" in err
    assert "dnf install liburing-devel" in err


def test_old_liburing_names_found_and_needed_versions(configure, tmp_path):
    pc = tmp_path / "pc"
    pc.mkdir()
    (pc / "liburing.pc").write_text("prefix=/opt/liburing-2.2\nName: liburing\nDescription: io_uring\n"
                                    "Version: 2.2\nLibs: -L${prefix}/lib -luring\nCflags: -I${prefix}/include\n")
    err = error_text(configure(env={"PKG_CONFIG_LIBDIR": str(pc)}))
    assert "liburing 2.2 found (/opt/liburing-2.2), pykvtier needs liburing >= 2.3" in err
    assert "apt-get install liburing-dev" in err and "dnf install liburing-devel" in err


def test_missing_xxhash_names_its_packages(configure, tmp_path):
    # Every standard include folder holding an xxhash.h is ignored by CMake's find_path.
    dirs = [d for d in ("/usr/local/include", "/usr/include") if os.path.exists(os.path.join(d, "xxhash.h"))]
    if not dirs:
        pytest.skip("no xxhash.h in /usr/include or /usr/local/include to hide")
    err = error_text(configure(f"-DCMAKE_IGNORE_PATH={';'.join(dirs)}"))
    assert "xxHash's header xxhash.h (xxHash >= 0.8.0) not found" in err
    assert "apt-get install libxxhash-dev" in err and "dnf install xxhash-devel" in err


def test_old_xxhash_is_refused_with_both_versions(configure, tmp_path):
    inc = tmp_path / "xxhash-0.7.3"
    inc.mkdir()
    (inc / "xxhash.h").write_text("#define XXH_VERSION_MAJOR    0\n#define XXH_VERSION_MINOR    7\n"
                                  "#define XXH_VERSION_RELEASE  3\n")
    err = error_text(configure(f"-DXXHASH_INCLUDE_DIR={inc}"))
    assert f"xxHash 0.7.3 at {inc}/xxhash.h, pykvtier needs xxHash >= 0.8.0" in err
    assert "apt-get install libxxhash-dev" in err


def test_missing_pkg_config_names_its_packages(configure, tmp_path):
    err = error_text(configure("-DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON"))
    assert "pkg-config not found" in err
    assert "apt-get install pkg-config" in err and "dnf install pkgconf-pkg-config" in err


def test_missing_pybind11_names_it_and_its_minimum(configure, tmp_path):
    err = error_text(configure("-DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON", pybind11=False))
    assert "pybind11 >= 2.12 not found" in err
    assert "pip install 'pybind11>=2.12'" in err and "pybind11-devel" in err


def test_missing_python_headers_name_their_packages(configure, tmp_path):
    err = error_text(configure("-DCMAKE_DISABLE_FIND_PACKAGE_Python=ON"))
    assert "Python's development files (Python.h" in err
    assert "apt-get install python3-dev" in err and "dnf install python3-devel" in err


def test_compiler_without_cxx20_is_named(configure, tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to wrap")
    # The real compiler, held at C++17 (the last -std wins): a compiler without C++20 to CMake.
    wrapper = tmp_path / "cxx17"
    wrapper.write_text(f'#!/bin/sh\nexec {cxx} "$@" -std=c++17\n')
    wrapper.chmod(0o755)
    err = error_text(configure(f"-DCMAKE_CXX_COMPILER={wrapper}"))
    assert f"{wrapper} (" in err and "does not compile C++20" in err
    assert "GCC >= 10 or Clang >= 10" in err
    assert "dnf install gcc-c++" in err


def test_no_cxx_compiler_is_named(configure, tmp_path):
    err = error_text(configure(env={"CXX": str(tmp_path / "no-such-c++")}))
    assert "no C++ compiler found (pykvtier needs C++20" in err
    assert "apt-get install g++" in err and "dnf install gcc-c++" in err
