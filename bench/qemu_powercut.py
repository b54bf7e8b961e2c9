"""Power-cut bench on the arm64 QEMU guest: boot times, then N cuts per disk mode.

Each cut boots the guest on a fresh ext4 disk served by nbdkit, runs the fsync-per-record append
workload (tests/qemu/powercut.py; the journal's generation workload will replace it), waits a
random 0.3-3 s after the first acknowledged record, kills nbdkit then QEMU, replays the ext4
journal and counts the intact records. Modes:
  writeback      nbdkit --filter=cache cache=writeback: unflushed writes die with nbdkit.
                 Expected: no acknowledged record lost, ever.
  discard-flush  the control (flushes dropped): acknowledged records MUST be lost, else the
                 harness cannot fail and the writeback result means nothing.
  plain          every write reaches the host file at once (killing QEMU only tests fsync
                 ordering inside the guest, not the disk's cache).
Prints one table; exit status 1 if writeback lost an acknowledged record or the control lost
none. Ratios within one run are what to quote (the machine is shared and noisy).

Run: .venv/bin/python bench/qemu_powercut.py [--cuts 20] [--boots 5] [--modes writeback,...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from qemu.build_arm64_guest import arm64_image  # noqa: E402
from qemu.guest import run_arm64  # noqa: E402
from qemu.powercut import CutResult, run_cut  # noqa: E402


def measure_boots(n: int) -> tuple[list[float], list[float]]:
    image = arm64_image()
    boots, walls = [], []
    for _ in range(n):
        r = run_arm64("true", image=image, with_source=False, timeout=120)
        if r.rc != 0 or r.boot_seconds is None:
            raise SystemExit(f"boot failed: rc={r.rc}; console tail: {r.console[-800:]!r}")
        boots.append(r.boot_seconds)
        walls.append(r.wall_seconds)
    return boots, walls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuts", type=int, default=20, help="power cuts per mode (default 20)")
    ap.add_argument("--boots", type=int, default=5, help="plain boots to time (default 5)")
    ap.add_argument("--modes", default="writeback,discard-flush,plain")
    ap.add_argument("--seed", type=int, default=1, help="seed of the cut delays")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)

    t0 = time.monotonic()
    image = arm64_image()
    print(f"guest image ready in {time.monotonic() - t0:.1f} s ({image.folder.name})")
    if args.boots:
        boots, walls = measure_boots(args.boots)
        print(f"boot to userspace: median {statistics.median(boots):.2f} s "
              f"(min {min(boots):.2f}, max {max(boots):.2f}); QEMU start to power-off "
              f"for `true`: median {statistics.median(walls):.2f} s over {args.boots} boots")

    results: dict[str, list[CutResult]] = {}
    for mode in args.modes.split(","):
        results[mode] = []
        for i in range(args.cuts):
            delay = rng.uniform(0.3, 3.0)
            t = time.monotonic()
            cut = run_cut(image, mode, delay)
            results[mode].append(cut)
            print(f"  {mode:13s} cut {i + 1:3d}/{args.cuts}: delay {delay:4.2f} s, acked "
                  f"{cut.acked:5d}, on disk {cut.on_disk:5d}, lost acked {cut.lost_acked:5d} "
                  f"({time.monotonic() - t:.1f} s)", file=sys.stderr, flush=True)

    print(f"\n{'mode':13s} {'cuts':>5s} {'acked':>8s} {'lost acked':>11s} "
          f"{'cuts losing':>12s} {'acked/s':>8s}")
    ok = True
    for mode, cuts in results.items():
        acked = sum(c.acked for c in cuts)
        lost = sum(c.lost_acked for c in cuts)
        losing = sum(1 for c in cuts if c.lost_acked)
        rate = statistics.median(c.acked / c.delay for c in cuts) if cuts else 0.0
        print(f"{mode:13s} {len(cuts):5d} {acked:8d} {lost:11d} {losing:12d} {rate:8.0f}")
        if mode in ("writeback", "plain") and lost:
            ok = False
        if mode == "discard-flush" and cuts and losing != len(cuts):
            ok = False
    print("verdict:", "OK" if ok else "FAILED (see the table: a mode did not behave)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
