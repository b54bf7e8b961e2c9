"""llama-cpp-python for the arm64 guest, cross-compiled on the host with Debian's aarch64 toolchain.

    .venv/bin/python tests/qemu/llama_aarch64.py       # builds (or finds) it; prints the folder

llama-cpp-python is pure ctypes over llama.cpp's shared libraries, so no aarch64 Python is needed
to build it: llama.cpp (vendored in the pinned PyPI sdist) is compiled with
aarch64-linux-gnu-gcc/g++ through a CMake toolchain file, and the package's Python files from the
same sdist are put next to the libraries. The result is one initramfs archive (`llama.cpio`) that
Arm64Guest appends at boot (`extra_initrds=`), so the base guest image never depends on it and
the tests that do not use it never wait for it.

Invariants: the build lives in $EDGE_AGENT_CACHE (default ~/.cache/edge-agent)/llama-aarch64/
llama-cpp-python-<version>-<hash>/, where <hash> covers the version, the CMake flags, both cross
compilers' `--version`, the toolchain file and the build steps' code; change any of them and the
next run rebuilds (a comment elsewhere in this file does not), a warm run
only hashes (~0.1 s). Nothing is downloaded at build time but the sdist (kept in the same
cache): curl, tools, tests, examples, server and web UI are off. The libraries carry RPATH
$ORIGIN and the SONAME links, so ctypes' `lib/libllama.so` finds `libggml*.so.0` beside it.
OpenMP is off (ggml's own thread pool; the guest has one vCPU and no libgomp).

Code paths: `-march=armv8.2-a+dotprod+fp16`, the ISA of the Cortex-A76 (RK3588, Raspberry Pi 5),
which the guest running it emulates (`-cpu cortex-a76`: asimddp and asimdhp in /proc/cpuinfo,
no pointer authentication, so TCG runs it as fast as the cortex-a72 of the other guests). ggml's
NEON kernels with SDOT are what a Q4_1/Q8_0 matrix product runs on such a board.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `qemu` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "qemu"  # noqa: A001

from qemu import cache, cpio  # noqa: E402
from qemu.errors import HarnessError, PackagesUnavailable  # noqa: E402

__all__ = ["ARM_ARCH", "CMAKE_ARGS", "CPU", "VERSION", "LlamaAarch64", "llama_aarch64", "main"]

VERSION = "0.3.36"  # the version pyproject's `llamacpp` extra pins
CPU = "cortex-a76"  # the QEMU CPU the guest must emulate to run this build
ARM_ARCH = "armv8.2-a+dotprod+fp16"  # Cortex-A76's ISA: NEON, SDOT/UDOT, FP16 arithmetic
CC, CXX = "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++"
TOOLCHAIN_PACKAGES = "gcc-aarch64-linux-gnu g++-aarch64-linux-gnu"
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={ARM_ARCH}", "-DGGML_OPENMP=OFF",
    "-DGGML_CCACHE=OFF", "-DGGML_BACKEND_DL=OFF",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
]
SITE = "usr/local/lib/python3.11/dist-packages"
LIBS = ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so")
TOOLCHAIN_FILE = """\
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER {cc})
set(CMAKE_CXX_COMPILER {cxx})
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
"""


@dataclass(frozen=True)
class LlamaAarch64:
    """A finished cross build: the initramfs overlay and what went into it (manifest.json)."""

    folder: Path
    cpio: Path
    manifest: dict[str, object]


def cache_dir() -> Path:
    """$EDGE_AGENT_CACHE, else $XDG_CACHE_HOME/edge-agent, else ~/.cache/edge-agent (the same
    root .ci/llama-wheel keeps the host's wheel in)."""
    env = os.environ.get("EDGE_AGENT_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edge-agent"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise HarnessError(f"{name}: not found on PATH. Hint: install the Debian packages "
                           f"{TOOLCHAIN_PACKAGES} cmake ninja-build (make deps-debian).")
    return path


def toolchain_versions() -> list[str]:
    """The first line of each cross compiler's --version (part of the cache key)."""
    out = []
    for c in (CC, CXX):
        p = subprocess.run([_tool(c), "--version"], capture_output=True, text=True, timeout=30,
                           check=False)
        out.append(p.stdout.splitlines()[0] if p.stdout else f"{c}: ?")
    return out


def _inputs_key() -> str:
    # what decides the bytes built: the pinned version, the flags, the toolchain and the build
    # steps' own code (not this whole file, so a comment elsewhere does not cost a rebuild)
    steps = [inspect.getsource(f) for f in (_build, _run, _ninja_with_progress)]
    return cache.inputs_hash([], [VERSION, ARM_ARCH, *CMAKE_ARGS, TOOLCHAIN_FILE, *steps,
                                  *toolchain_versions()])


def _sdist() -> Path:
    """The pinned sdist, downloaded once into the cache (pip download, no build)."""
    folder = cache_dir() / "sdist"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    if (folder / name).is_file():
        return folder / name
    cache.log(f"pip download llama-cpp-python=={VERSION} (sdist, ~77 MB)")
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q",
           "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(folder)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if p.returncode != 0 or not (folder / name).is_file():
        raise PackagesUnavailable(f"`{' '.join(cmd)}` exited {p.returncode}: "
                                  f"{p.stderr.strip()[-800:]}. Hint: check that PyPI is "
                                  "reachable.")
    return folder / name


def _run(cmd: list[str], what: str, log_path: Path, **kw: object) -> None:
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False,
                           **kw)  # type: ignore[call-overload]  # subprocess.run's keywords, passed on
    if p.returncode != 0:
        tail = log_path.read_bytes()[-2500:].decode("utf-8", "replace")
        raise HarnessError(f"{what}: exited {p.returncode}. Log tail: {tail}. Hint: the full "
                           f"log is {log_path}.")


def _ninja_with_progress(build: Path, log_path: Path, jobs: int) -> None:
    """ninja (niced), with a progress line on stderr every ~30 s."""
    cmd = ["nice", "-n", "10", _tool("ninja"), "-C", str(build), f"-j{jobs}", "llama"]
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
            assert proc.stdout is not None
            last = time.monotonic()
            t0 = last
            for line in proc.stdout:
                log.write(line)
                m = re.match(rb"\[(\d+)/(\d+)\]", line)
                if m and time.monotonic() - last > 30:
                    last = time.monotonic()
                    cache.log(f"llama.cpp aarch64: {m.group(1).decode()}/"
                              f"{m.group(2).decode()} steps, {last - t0:.0f} s")
            rc = proc.wait()  # the with block closes the pipe (no fd left for the GC)
    if rc != 0:
        tail = log_path.read_bytes()[-2500:].decode("utf-8", "replace")
        raise HarnessError(f"ninja llama (aarch64): exited {rc}. Log tail: {tail}. Hint: the "
                           f"full log is {log_path}.")


def _elf_machine(path: Path) -> int:
    with open(path, "rb") as f:
        head = f.read(20)
    return int.from_bytes(head[18:20], "little") if head[:4] == b"\x7fELF" else -1


def _build(dest: Path) -> None:
    sdist = _sdist()
    jobs = int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or os.cpu_count() or 2)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ea-llama-aarch64-") as tmp:
        work = Path(tmp)
        log_path = dest / "build.log"
        with tarfile.open(sdist) as tf:
            tf.extractall(work, filter="data")
        src = work / f"llama_cpp_python-{VERSION}"
        toolchain = work / "aarch64.cmake"
        toolchain.write_text(TOOLCHAIN_FILE.format(cc=_tool(CC), cxx=_tool(CXX)))
        build = work / "build"
        cache.log(f"llama.cpp aarch64: configuring ({ARM_ARCH}, {jobs} jobs, niced)")
        _run([_tool("cmake"), "-S", str(src / "vendor" / "llama.cpp"), "-B", str(build),
              "-G", "Ninja", f"-DCMAKE_TOOLCHAIN_FILE={toolchain}", *CMAKE_ARGS],
             "cmake configure (aarch64)", log_path, timeout=600)
        _ninja_with_progress(build, log_path, jobs)
        root = work / "root"
        pkg = root / SITE / "llama_cpp"
        shutil.copytree(src / "llama_cpp", pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "lib"))
        (pkg / "lib").mkdir()
        strip = _tool("aarch64-linux-gnu-strip")
        for lib in LIBS:
            found = sorted(build.rglob(lib))
            if not found:
                raise HarnessError(f"{lib}: not produced by the aarch64 build. Hint: see "
                                   f"{log_path}.")
            real = found[0].resolve()
            if _elf_machine(real) != 183:  # EM_AARCH64
                raise HarnessError(f"{real}: not an aarch64 ELF. Hint: the toolchain file was "
                                   "not used; see the log.")
            shutil.copy2(real, pkg / "lib" / real.name)
            subprocess.run([strip, "--strip-unneeded", str(pkg / "lib" / real.name)],
                           check=True, timeout=120)
            # lib.so -> lib.so.0 -> lib.so.0.x.y, as the SONAME and ctypes expect
            for link in {found[0].name, *(p.name for p in found[0].parent.glob(lib + ".*")
                                          if p.is_symlink())}:
                if link != real.name:
                    (pkg / "lib" / link).symlink_to(real.name)
        (root / SITE / "llama_cpp_python-cross.txt").write_text(
            f"llama-cpp-python {VERSION} cross-compiled for aarch64 ({ARM_ARCH})\n")
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "-s", str(root), "-p", "/",
             "--invalidation-mode", "unchecked-hash", str(root / SITE)],
            check=False, capture_output=True, timeout=300)
        with open(dest / "llama.cpio", "wb") as out:
            w = cpio.CpioWriter(out)
            w.tree(root)
            w.close()
        libs = {p.name: p.stat().st_size for p in sorted((pkg / "lib").iterdir())
                if not p.is_symlink()}
    manifest = {
        "version": VERSION, "arm_arch": ARM_ARCH, "cpu": CPU, "cmake_args": CMAKE_ARGS,
        "toolchain": toolchain_versions(), "libs": libs,
        "cpio_bytes": (dest / "llama.cpio").stat().st_size,
        "build_seconds": round(time.monotonic() - t0, 1),
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def llama_aarch64() -> LlamaAarch64:
    """The cached cross build, built first if needed (PackagesUnavailable when PyPI is down)."""
    for tool in (CC, CXX, "cmake", "ninja"):
        _tool(tool)
    folder = cache.cached_build(f"llama-cpp-python-{VERSION}", _inputs_key(), _build,
                                root=cache_dir() / "llama-aarch64")
    manifest = json.loads((folder / "manifest.json").read_text())
    return LlamaAarch64(folder, folder / "llama.cpio", manifest)


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    built = llama_aarch64()
    print(built.folder)
    sha = hashlib.sha256(built.cpio.read_bytes()).hexdigest()[:16]
    print(f"llama-cpp-python {VERSION} aarch64 ({ARM_ARCH}): {built.cpio.stat().st_size / 1e6:.1f}"
          f" MB overlay (sha256 {sha}), build {built.manifest['build_seconds']} s, this run "
          f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
