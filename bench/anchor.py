"""The anchor: llama-server and llama-bench built from the llama.cpp that llama-cpp-python vendors.

The llama.cpp engine runs llama-cpp-python 0.3.36 (.ci/llama-wheel builds it from the PyPI sdist).
The benchmarks compare it with llama.cpp's own server and bench built from the same source: the
sdist's `vendor/llama.cpp`, with the instruction-set flags .ci/llama-wheel chooses (on x86-64 the
CPU's own sets named one by one, AMX off: this VM lists AMX and llama.cpp's AMX kernels crash
here; elsewhere CMAKE_ARGS), server on, web UI neither built nor fetched, no curl, and only the
two targets. Nothing is downloaded but the sdist. The binaries are cached under
$EDGE_AGENT_CACHE/anchor-<key> (default ~/.cache/edge-agent), keyed like the wheel (version,
flags, machine, CPU flags) and built once under a lock; the build runs at nice 10 with
CMAKE_BUILD_PARALLEL_LEVEL=2 (about as long as the wheel: 6-15 min on 2 cores).

    .venv/bin/python bench/anchor.py     (progress on stderr, the binaries' directory on stdout)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

__all__ = ["VERSION", "anchor_bins", "cmake_args"]

VERSION = "0.3.36"  # the pin of llama-cpp-python (pyproject.toml, .ci/llama-wheel)
TARGETS = ("llama-server", "llama-bench")
# What the anchor needs besides the instruction sets: the server without its web UI (neither
# built nor fetched from its bucket), no curl, static libraries so the cached binaries do not
# point into a build tree that is gone.
BUILD_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_CURL=OFF",
              "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF")


def _log(msg: str) -> None:
    print(f"anchor: {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    env = os.environ.get("EDGE_AGENT_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edge-agent"


def _cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def cmake_args() -> str:
    """The instruction-set arguments .ci/llama-wheel gives the wheel's build, the same way."""
    if "CMAKE_ARGS" not in os.environ and platform.machine() == "x86_64":
        flags = set(_cpu_flags_line().partition(":")[2].split())

        def has(flag: str) -> str:
            return "ON" if flag in flags else "OFF"

        return (f"-DGGML_NATIVE=OFF -DGGML_AVX={has('avx')} -DGGML_AVX2={has('avx2')} "
                f"-DGGML_FMA={has('fma')} -DGGML_F16C={has('f16c')} -DGGML_BMI2={has('bmi2')} "
                f"-DGGML_AVX_VNNI={has('avx_vnni')} -DGGML_AVX512={has('avx512f')} "
                f"-DGGML_AVX512_VBMI={has('avx512vbmi')} "
                f"-DGGML_AVX512_VNNI={has('avx512_vnni')} "
                f"-DGGML_AVX512_BF16={has('avx512_bf16')} "
                "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
    return os.environ.get("CMAKE_ARGS", "")


def cache_key(isa: str) -> str:
    parts = [VERSION, isa, " ".join(BUILD_ARGS), platform.machine(), _cpu_flags_line()]
    return hashlib.sha256(("\n".join(parts) + "\n").encode()).hexdigest()[:16]


def _run(argv: list[str], **kw: object) -> None:
    _log("$ " + " ".join(argv))
    subprocess.run(argv, check=True, stdout=sys.stderr, **kw)  # type: ignore[call-overload]  # subprocess.run's keywords, passed on


def _build(dest: Path, isa: str, python: str) -> None:
    root = cache_root()
    with tempfile.TemporaryDirectory(prefix=".anchor-build.", dir=root) as tmp_s:
        tmp = Path(tmp_s)
        start = time.monotonic()
        _log(f"downloading the llama-cpp-python {VERSION} sdist (its vendor/llama.cpp)")
        _run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={VERSION}", "-d", str(tmp / "sdist")])
        sdist = next((tmp / "sdist").glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(tmp / "src", members=members, filter="data")
        src = tmp / "src" / prefix
        build = tmp / "build"
        env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL="2")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _log(f"configuring llama.cpp from {sdist.name} ({isa or 'default flags'})")
        _run(["nice", "-n", "10", "cmake", "-S", str(src), "-B", str(build), *gen,
              *BUILD_ARGS, *isa.split()], env=env)
        _log(f"building {' and '.join(TARGETS)} (nice 10, 2 jobs; 6-15 min on 2 cores)")
        _run(["nice", "-n", "10", "cmake", "--build", str(build), "--target", *TARGETS],
             env=env)
        out = tmp / "out"
        out.mkdir()
        for name in TARGETS:
            shutil.copy2(build / "bin" / name, out / name)
        (out / "build-info.txt").write_text(
            f"llama-cpp-python {VERSION} sdist, vendor/llama.cpp\n"
            f"cmake {' '.join(BUILD_ARGS)} {isa}\n"
            f"built {time.strftime('%Y-%m-%d %H:%M:%S')} in {time.monotonic() - start:.0f} s\n")
        if dest.exists():
            shutil.rmtree(dest)
        out.rename(dest)
        _log(f"built in {time.monotonic() - start:.0f} s: {dest}")


def anchor_bins(python: str | None = None) -> dict[str, Path]:
    """Paths of llama-server and llama-bench, built once per key (the first call may take
    minutes; concurrent callers wait on the lock)."""
    isa = cmake_args()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"anchor-{cache_key(isa)}"
    with open(root / ".anchor.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((dest / name).is_file() for name in TARGETS):
            _build(dest, isa, python or sys.executable)
        else:
            _log(f"cached {dest}")
    return {"server": dest / "llama-server", "bench": dest / "llama-bench"}


def main() -> int:
    bins = anchor_bins()
    print(bins["server"].parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
