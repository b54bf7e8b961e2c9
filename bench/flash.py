"""Flash benchmark: our flasher vs Debian's stm32flash, same image, same simulator, same link.

Both talk to the AN3155 simulator served on a pty by `python -m firmware_tools.simulator --pty`
(8N1 on the pty; a pty cannot do parity), 115200 baud nominal (a pty does not pace bytes, so the
times measure round trips and protocol work, not wire time). Each run gets a fresh simulator
with an erased flash. stm32flash: `stm32flash -m 8n1 -b 115200 -w fw.bin -v PTY` (write +
verify, no go). Ours: `flash_elf(..., go=False)` (ELF checks, read-before-erase, erase, write,
verify). One run each, same process order. Also: a re-flash of the image already on the chip,
and the time to check a 1 MiB ELF (load_elf + plan_flash; target < 100 ms).

Run: .venv/bin/python bench/flash.py [--kib 96]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from firmware_tools.flasher import flash_elf  # noqa: E402
from firmware_tools.image import load_elf  # noqa: E402
from firmware_tools.plan import plan_flash  # noqa: E402
from firmware_tools.profiles import load_profile  # noqa: E402

EXAMPLES = ROOT / "firmware_tools" / "examples"
CFLAGS = ["-mcpu=cortex-m4", "-mthumb", "-Os", "-nostdlib", "-ffreestanding",
          "-fno-unwind-tables", "-Wl,--gc-sections", "-Wl,--no-warn-rwx-segments"]


def build(out: Path, blob: int) -> tuple[Path, Path]:
    cc = shutil.which("arm-none-eabi-gcc")
    objcopy = shutil.which("arm-none-eabi-objcopy")
    if not cc or not objcopy:
        sys.exit("bench/flash.py: arm-none-eabi-gcc is missing. Hint: make deps-debian")
    elf, binary = out / f"fw{blob}.elf", out / f"fw{blob}.bin"
    subprocess.run([cc, *CFLAGS, f"-DBLOB_SIZE={blob}", "-T", str(EXAMPLES / "stm32f405.ld"),
                    "-o", str(elf), str(EXAMPLES / "startup.c"), str(EXAMPLES / "main.c")],
                   check=True)
    subprocess.run([objcopy, "-O", "binary", str(elf), str(binary)], check=True)
    return elf, binary


class Served:
    """A simulator on a pty, in its own process, for the length of a `with`; afterwards
    `wire` holds the bytes each way it counted."""

    def __init__(self, state: Path, extra: str = "") -> None:
        self.url = f"stm32sim://?chip=f405&state={state}" + (f"&{extra}" if extra else "")
        self.wire = ""

    def __enter__(self) -> Served:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "firmware_tools.simulator", "--pty", "--url", self.url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        assert self.proc.stdout is not None
        self.pty = self.proc.stdout.readline().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=10)
        found = re.search(r"host sent (\d+) bytes, board sent (\d+) bytes", err)
        self.wire = f"{found[1]} B out + {found[2]} B back" if found else "?"


def run_stm32flash(binary: Path, pty: str) -> float:
    tool = shutil.which("stm32flash")
    if not tool:
        sys.exit("bench/flash.py: stm32flash is missing. Hint: make deps-debian")
    t0 = time.perf_counter()
    done = subprocess.run([tool, "-m", "8n1", "-b", "115200", "-w", str(binary), "-v", pty],
                          capture_output=True, text=True)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"stm32flash failed:\n{done.stdout}\n{done.stderr}")
    return took


def run_ours(elf: Path, pty: str) -> tuple[float, object]:
    profile = load_profile("stm32f405")
    t0 = time.perf_counter()
    result = flash_elf(elf, profile, pty, go=False, baud=115200)
    return time.perf_counter() - t0, result


def compare(tmp: Path, elf: Path, binary: Path, label: str, extra: str) -> None:
    times: dict[str, float] = {}
    wire: dict[str, str] = {}
    results = {}
    for who in ("stm32flash", "ours"):
        state = tmp / f"{label}-{who}.bin"
        for run in ("fresh", "again"):
            with Served(state, extra) as server:
                pty = server.pty
                if who == "stm32flash":
                    times[who + run] = run_stm32flash(binary, pty)
                else:
                    times[who + run], results[run] = run_ours(elf, pty)
            wire[who + run] = server.wire
    if (tmp / f"{label}-ours.bin").read_bytes() != (tmp / f"{label}-stm32flash.bin").read_bytes():
        sys.exit("the two tools left different flash contents")
    size = binary.stat().st_size
    print(f"[{label}] image {size} bytes, sectors {results['fresh'].sectors}")  # type: ignore
    for run, what in (("fresh", "fresh chip"), ("again", "same image again")):
        ours, theirs = times["ours" + run], times["stm32flash" + run]
        print(f"[{label}] {what}: ours {ours:.3f} s ({wire['ours' + run]}), stm32flash -v "
              f"{theirs:.3f} s ({wire['stm32flash' + run]}), ratio {ours / theirs:.3f}"
              + (" (target <= 1.0)" if run == "fresh" else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kib", type=int, default=24,
                        help="image size in KiB for the paced run (default 24: sectors 0-1)")
    parser.add_argument("--raw-kib", type=int, default=96,
                        help="image size in KiB for the unpaced run (default 96)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flashbench-") as tmp_name:
        tmp = Path(tmp_name)
        elf, binary = build(tmp, args.kib * 1024 - 600)
        compare(tmp, elf, binary, "paced 115200 8N1", "baud=115200")
        elf, binary = build(tmp, args.raw_kib * 1024 - 600)
        compare(tmp, elf, binary, "unpaced pty", "")
        big_elf, _ = build(tmp, 1000 * 1000)
        profile = load_profile("stm32f405")
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            image = load_elf(big_elf, profile)
            plan_flash(image, profile)
            times.append(time.perf_counter() - t0)
        print(f"check of a {big_elf.stat().st_size} byte ELF ({len(image.data)} byte image): "
              f"{min(times) * 1000:.1f} ms best of 3, first {times[0] * 1000:.1f} ms "
              f"(target < 100 ms, ratio to target {min(times) / 0.1:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
