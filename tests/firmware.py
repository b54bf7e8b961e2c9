"""Test helper: build the example firmware and bad-ELF variants with real toolchains.

Used by the firmware tests (and the flasher's end-to-end tests) to get real ELF files:

    import firmware                      # tests/ is on sys.path under pytest

    @pytest.fixture(scope="session")
    def fw(tmp_path_factory):
        return firmware.builder(tmp_path_factory)

    def test_x(fw):
        elf = fw.elf("good")             # built once per session, cached on disk
        binary = fw.objcopy_bin("good")  # arm-none-eabi-objcopy -O binary

Every variant comes from firmware_tools/examples/ (startup.c, main.c, stm32f405.ld) with one
change, so each bad ELF differs from a good one by exactly the fault it demonstrates. Tests that
need a tool call `require(tool)`, which skips loudly when it is absent (CI installs them).

`served(url, "--pty")` (or `"--tcp", "0"`) runs the bootloader simulator as a separate process
and yields the pty path (or host:port) to talk to, for tests that need a real tty or socket:

    with firmware.served("stm32sim://?chip=f405", "--pty") as (pty, proc):
        ...
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import firmware_tools

__all__ = [
    "EXAMPLES",
    "FirmwareBuilder",
    "GREETING",
    "VARIANTS",
    "boot_qemu",
    "builder",
    "require",
    "served",
]

EXAMPLES = Path(firmware_tools.__file__).resolve().parent / "examples"
GREETING = "edge-agent example firmware: .data copied from flash"
CC = "arm-none-eabi-gcc"
OBJCOPY = "arm-none-eabi-objcopy"
QEMU = "qemu-system-arm"
CFLAGS = (
    "-mcpu=cortex-m4", "-mthumb", "-Os", "-g", "-nostdlib", "-ffreestanding",
    "-fno-unwind-tables", "-Wall", "-Wextra", "-Werror",
)
LDFLAGS = ("-Wl,--gc-sections", "-Wl,--no-warn-rwx-segments")
SOURCES = ("startup.c", "main.c")

# variant -> (linker-script edits, extra compiler flags); see _build_arm.
_ARM_VARIANTS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[str, ...]]] = {
    "good": ((), ()),
    # ~1 MiB of constant data in flash: the size and speed case (fits the F405's 1 MiB).
    "big": ((), ("-DBLOB_SIZE=1000000",)),
    # ORIGIN not on a sector start, linked with --nmagic so no headers are loaded.
    "misaligned": ((("ORIGIN = 0x08000000", "ORIGIN = 0x08000100"),), ("-Wl,-n",)),
    # Same ORIGIN, default link: GNU ld puts the ELF and program headers in the first segment.
    "headers": ((("ORIGIN = 0x08000000", "ORIGIN = 0x08000100"),), ()),
    # .data without `AT> FLASH`: its load address is its RAM address.
    "no_at": ((("> RAM AT> FLASH", "> RAM"),), ()),
    # .data loaded over .text (the linker's own overlap check turned off).
    "overlap": (
        ((".data : ALIGN(4)", ".data : AT(0x08000010) ALIGN(4)"), ("> RAM AT> FLASH", "> RAM")),
        ("-Wl,--no-check-sections",),
    ),
    # .data's load address rounded up to 256 bytes: a gap between the segments.
    "gap": (
        (
            (".data : ALIGN(4)",
             ".data : AT(ALIGN(LOADADDR(.text) + SIZEOF(.text), 0x100)) ALIGN(4)"),
            ("> RAM AT> FLASH", "> RAM"),
        ),
        (),
    ),
    # .bss at its own RAM address: a PT_LOAD with p_filesz 0 (must be skipped, not rejected).
    "bss_segment": (((".bss (NOLOAD) :", ".bss 0x20010000 (NOLOAD) :"),), ()),
    "big_endian": ((), ("-mbig-endian",)),
}
VARIANTS = (
    *_ARM_VARIANTS,
    "object",  # main.c compiled with -c: ET_REL, no program headers
    "x86_64",  # host gcc -nostdlib -static: ELF64, EM_X86_64
    "machine",  # the good ELF with e_machine patched to EM_386 (ELF32 LE, wrong machine)
    "truncated",  # the good ELF cut in the middle of segment 0's bytes
    "not_elf",  # the good firmware's objcopy .bin
)


def require(tool: str) -> str:
    """Path of `tool`, or skip the test loudly (CI installs every tool the tests use)."""
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is NOT INSTALLED: this test needs it (run `make deps-debian`)")
    return path


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")


class FirmwareBuilder:
    """Builds each variant once into `out_dir` and returns its path."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._built: dict[str, Path] = {}

    def elf(self, variant: str = "good") -> Path:
        if variant not in VARIANTS:
            raise ValueError(f"unknown firmware variant {variant!r}; known: {', '.join(VARIANTS)}")
        if variant not in self._built:
            self._built[variant] = self._build(variant)
        return self._built[variant]

    def objcopy_bin(self, variant: str = "good", gap_fill: int | None = None) -> Path:
        """`arm-none-eabi-objcopy -O binary` of a variant (the oracle for the image bytes)."""
        suffix = "" if gap_fill is None else f"-fill{gap_fill:02x}"
        out = self.out_dir / f"{variant}{suffix}.bin"
        if not out.exists():
            fill = [] if gap_fill is None else ["--gap-fill", f"0x{gap_fill:02x}"]
            _run([require(OBJCOPY), "-O", "binary", *fill, str(self.elf(variant)), str(out)],
                 self.out_dir)
        return out

    def _build(self, variant: str) -> Path:
        builders: dict[str, Callable[[], Path]] = {
            "object": self._build_object,
            "x86_64": self._build_x86_64,
            "machine": self._build_machine,
            "truncated": self._build_truncated,
            "not_elf": lambda: self.objcopy_bin("good"),
        }
        if variant in builders:
            return builders[variant]()
        return self._build_arm(variant)

    def _build_arm(self, variant: str) -> Path:
        edits, flags = _ARM_VARIANTS[variant]
        script = (EXAMPLES / "stm32f405.ld").read_text()
        for old, new in edits:
            assert old in script, f"variant {variant}: {old!r} not in the linker script"
            script = script.replace(old, new)
        ld = self.out_dir / f"{variant}.ld"
        ld.write_text(script)
        out = self.out_dir / f"{variant}.elf"
        sources = [str(EXAMPLES / s) for s in SOURCES]
        _run([require(CC), *CFLAGS, *flags, "-T", str(ld), *LDFLAGS, "-o", str(out), *sources],
             self.out_dir)
        return out

    def _build_object(self) -> Path:
        out = self.out_dir / "main.o"
        _run([require(CC), *CFLAGS, "-c", "-o", str(out), str(EXAMPLES / "main.c")], self.out_dir)
        return out

    def _build_x86_64(self) -> Path:
        src = self.out_dir / "host.c"
        src.write_text("void _start(void) { for (;;) { } }\n")
        out = self.out_dir / "x86_64.elf"
        _run([require("gcc"), "-nostdlib", "-static", "-o", str(out), str(src)], self.out_dir)
        return out

    def _build_machine(self) -> Path:
        data = bytearray(self.elf("good").read_bytes())
        data[18:20] = (3).to_bytes(2, "little")  # e_machine = EM_386
        out = self.out_dir / "machine.elf"
        out.write_bytes(bytes(data))
        return out

    def _build_truncated(self) -> Path:
        from elftools.elf.elffile import ELFFile

        good = self.elf("good")
        with good.open("rb") as fh:
            seg = next(s for s in ELFFile(fh).iter_segments() if s["p_type"] == "PT_LOAD")
            cut = seg["p_offset"] + seg["p_filesz"] // 2
        out = self.out_dir / "truncated.elf"
        out.write_bytes(good.read_bytes()[:cut])
        return out


_BUILDERS: dict[Path, FirmwareBuilder] = {}


def builder(tmp_path_factory: pytest.TempPathFactory) -> FirmwareBuilder:
    """The session's FirmwareBuilder (one build directory per pytest session)."""
    base = tmp_path_factory.getbasetemp()
    if base not in _BUILDERS:
        _BUILDERS[base] = FirmwareBuilder(tmp_path_factory.mktemp("firmware"))
    return _BUILDERS[base]


def boot_qemu(flash_bin: Path, *, expect: str = GREETING, timeout: float = 10.0) -> str:
    """Boot a raw flash image at 0x08000000 on QEMU's netduinoplus2 (STM32F405) and return the
    UART output up to and including `expect` (or everything seen when `timeout` expires).
    """
    cmd = [
        require(QEMU), "-M", "netduinoplus2", "-nographic", "-monitor", "none",
        "-serial", "stdio", "-device", f"loader,file={flash_bin},addr=0x08000000",
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while expect.encode() not in out and time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                out += chunk
        sel.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    return out.decode("latin-1")


@contextmanager
def served(url: str, *mode: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Run `python -m firmware_tools.simulator --pty|--tcp 0 --url URL`; yield its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "firmware_tools.simulator", *mode, "--url", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line, f"simulator did not start: {proc.stderr.read() if proc.stderr else ''}"
        yield line, proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
