"""Flash benchmark: our flasher vs Debian's stm32flash, same image, same simulator, same link.

Both talk to the AN3155 simulator served on a pty by `python -m firmware_tools.simulator --pty`
(8N1 on the pty; a pty cannot do parity). Paced runs use the simulator's `baud=115200` knob
(every byte takes 10/115200 s each way, so the wire alone costs ~4.45 s for the 24 KiB image);
unpaced runs measure round trips and protocol work only. Each flash gets a fresh simulator with
an erased flash. stm32flash: `stm32flash -m 8n1 -b 115200 -w fw.bin -v PTY` (write + verify,
no go). Ours: `flash_elf(..., go=False)` (ELF checks, read-before-erase, erase, write, verify
every block), timed from the call to its return; pyserial is imported before the clock starts
(stm32flash's process start is in its time, ours is not either way).

`--runs N` alternates which tool goes first and prints the median ratio and its spread: the
machine is shared, single runs move by a few per cent. `--timeline` has the simulator log when
each frame arrived and each reply left (its `timeline` knob) and prints, per tool, the median
reply latency: from the simulator's last reply byte to the client's next frame.
Also: a re-flash of the image already on the chip, and the check of a 1 MiB ELF (< 100 ms).

Run: .venv/bin/python bench/flash.py [--runs 5] [--kib 24] [--raw-kib 96] [--timeline]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import serial.serialposix  # noqa: E402, F401  (imported before any clock starts)

from firmware_tools.flasher import flash_elf  # noqa: E402
from firmware_tools.image import load_elf  # noqa: E402
from firmware_tools.plan import plan_flash  # noqa: E402
from firmware_tools.profiles import load_profile  # noqa: E402

EXAMPLES = ROOT / "firmware_tools" / "examples"
CFLAGS = ["-mcpu=cortex-m4", "-mthumb", "-Os", "-nostdlib", "-ffreestanding",
          "-fno-unwind-tables", "-Wl,--gc-sections", "-Wl,--no-warn-rwx-segments"]
TOOLS = ("stm32flash", "ours")


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
    `wire` holds the bytes each way it counted and `timeline` its log (timeline knob)."""

    def __init__(self, state: Path, extra: str = "", timeline: Path | None = None) -> None:
        self.url = f"stm32sim://?chip=f405&state={state}" + (f"&{extra}" if extra else "")
        if timeline is not None:
            self.url += f"&timeline={timeline}"
        self.timeline_path = timeline
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

    def reply_latencies(self) -> list[float]:
        """Seconds from each reply the simulator wrote to the next frame it read."""
        if self.timeline_path is None or not self.timeline_path.exists():
            return []
        rows = [line.split("\t") for line in self.timeline_path.read_text().splitlines()]
        return [float(b[1]) - float(a[1]) for a, b in zip(rows, rows[1:], strict=False)
                if a[0] == "tx" and b[0] == "rx"]


def run_stm32flash(binary: Path, pty: str) -> float:
    tool = shutil.which("stm32flash")
    if not tool:
        sys.exit("bench/flash.py: stm32flash is missing. Hint: make deps-debian")
    # Its output goes to a file, not a pipe: a pipe would wake this process for every
    # progress line while stm32flash waits for the simulator (a cost that is not stm32flash's).
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        done = subprocess.run([tool, "-m", "8n1", "-b", "115200", "-w", str(binary), "-v", pty],
                              stdout=out, stderr=subprocess.STDOUT)
        took = time.perf_counter() - t0
        if done.returncode != 0:
            out.seek(0)
            sys.exit(f"stm32flash failed:\n{out.read()}")
    return took


def run_ours(elf: Path, pty: str) -> tuple[float, object]:
    profile = load_profile("stm32f405")
    t0 = time.perf_counter()
    result = flash_elf(elf, profile, pty, go=False, baud=115200)
    return time.perf_counter() - t0, result


def one(who: str, elf: Path, binary: Path, state: Path, extra: str,
        timeline: Path | None) -> tuple[float, str, list[float], object]:
    with Served(state, extra, timeline) as server:
        if who == "stm32flash":
            took, result = run_stm32flash(binary, server.pty), None
        else:
            took, result = run_ours(elf, server.pty)
    return took, server.wire, server.reply_latencies(), result


def compare(tmp: Path, elf: Path, binary: Path, label: str, extra: str, runs: int,
            timeline: bool) -> None:
    times: dict[str, list[float]] = {who: [] for who in TOOLS}
    lat: dict[str, list[float]] = {who: [] for who in TOOLS}
    lat_sum: dict[str, list[float]] = {who: [] for who in TOOLS}
    wire: dict[str, str] = {}
    ratios = []
    result = None
    for run in range(runs):
        order = TOOLS if run % 2 == 0 else TOOLS[::-1]
        took: dict[str, float] = {}
        for who in order:
            state = tmp / f"{label}-{who}-{run}.bin"
            log = tmp / f"{label}-{who}-{run}.tsv" if timeline else None
            took[who], wire[who], gaps, res = one(who, elf, binary, state, extra, log)
            result = res if res is not None else result
            times[who].append(took[who])
            if gaps:
                lat[who].append(statistics.median(gaps))
                lat_sum[who].append(sum(gaps))
        a, b = (tmp / f"{label}-{who}-{run}.bin" for who in TOOLS)
        if a.read_bytes() != b.read_bytes():
            sys.exit("the two tools left different flash contents")
        ratios.append(took["ours"] / took["stm32flash"])
        print(f"[{label}] run {run + 1}/{runs} ({order[0]} first): ours {took['ours']:.3f} s, "
              f"stm32flash {took['stm32flash']:.3f} s, ratio {ratios[-1]:.3f}", flush=True)
    size = binary.stat().st_size
    print(f"[{label}] image {size} bytes, sectors {result.sectors}")  # type: ignore[attr-defined]  # our last flash_elf result
    med = {who: statistics.median(times[who]) for who in TOOLS}
    print(f"[{label}] fresh chip, median of {runs}: ours {med['ours']:.3f} s "
          f"({wire['ours']}), stm32flash -v {med['stm32flash']:.3f} s ({wire['stm32flash']}); "
          f"ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}; target <= 1.0)")
    if timeline and lat["ours"] and lat["stm32flash"]:
        print(f"[{label}] reply latency at the simulator (its reply out -> next frame in), "
              "median per run, then the median of those: "
              + "; ".join(f"{who} {statistics.median(lat[who]) * 1e6:.1f} us "
                          f"(sum {statistics.median(lat_sum[who]) * 1e3:.1f} ms)"
                          for who in TOOLS))
    again = {who: one(who, elf, binary, tmp / f"{label}-{who}-0.bin", extra, None)
             for who in TOOLS}
    ours, theirs = again["ours"], again["stm32flash"]
    print(f"[{label}] same image again: ours {ours[0]:.3f} s ({ours[1]}), stm32flash -v "
          f"{theirs[0]:.3f} s ({theirs[1]}), ratio {ours[0] / theirs[0]:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5,
                        help="fresh-chip flashes per tool and link, order alternating "
                             "(default 5)")
    parser.add_argument("--kib", type=int, default=24,
                        help="image size in KiB for the paced run (default 24: sectors 0-1)")
    parser.add_argument("--raw-kib", type=int, default=96,
                        help="image size in KiB for the unpaced run (default 96)")
    parser.add_argument("--timeline", action="store_true",
                        help="log frame times in the simulator and print reply latencies")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="flashbench-") as tmp_name:
        tmp = Path(tmp_name)
        elf, binary = build(tmp, args.kib * 1024 - 600)
        compare(tmp, elf, binary, "paced 115200 8N1", "baud=115200", args.runs, args.timeline)
        elf, binary = build(tmp, args.raw_kib * 1024 - 600)
        compare(tmp, elf, binary, "unpaced pty", "", args.runs, args.timeline)
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
