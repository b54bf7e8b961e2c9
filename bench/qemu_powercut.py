"""Power-cut bench on the arm64 QEMU guest: boot times, then N cuts per disk mode.

Workload `journal` (the default): the daemon generates with the tiny llama (tests/qemu/
tiny_model.py) and its state directory on a fresh ext4 disk served by nbdkit; requests are
submitted continuously; power is cut a random 0.5-4 s after the first acknowledged request;
the guest boots again, reads the journal with sqlite3 before the daemon (integrity_check,
requests, tokens), warm-starts the daemon, lets every request finish and reads it again
(tests/qemu/journal_cut.py). A cut is bad if an acknowledged request is missing or does not
complete, a journaled token changed, or integrity_check is not ok.

Workload `records`: the fsync-per-record append loop (tests/qemu/powercut.py), a random
0.3-3 s after the first acknowledged record, counting intact records after an ext4 journal
replay. Modes:
  writeback      nbdkit --filter=cache cache=writeback: unflushed writes die with nbdkit.
                 Expected: no acknowledged record lost, ever.
  discard-flush  the control (flushes dropped): acknowledged records MUST be lost, else the
                 harness cannot fail and the writeback result means nothing.
  plain          every write reaches the host file at once (killing QEMU only tests fsync
                 ordering inside the guest, not the disk's cache).
Prints one table; exit status 1 if writeback lost an acknowledged record or the control lost
none. Ratios within one run are what to quote (the machine is shared and noisy).

Run: .venv/bin/python bench/qemu_powercut.py [--workload journal|records] [--cuts 20]
         [--control-cuts 3] [--boots 5] [--modes writeback,...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from qemu.build_arm64_guest import arm64_image  # noqa: E402
from qemu.errors import HarnessError  # noqa: E402
from qemu.guest import run_arm64  # noqa: E402
from qemu.journal_cut import JournalCut, run_journal_cut  # noqa: E402
from qemu.powercut import CutResult, run_cut  # noqa: E402
from qemu.tiny_model import write_tiny_llama  # noqa: E402


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


def journal_bench(args: argparse.Namespace, rng: random.Random) -> bool:
    image = arm64_image()
    results: dict[str, list[JournalCut]] = {}
    failures = 0
    with tempfile.TemporaryDirectory(prefix="ea-bench-") as tmp:
        model = write_tiny_llama(Path(tmp) / "tiny.gguf")
        for mode in args.modes.split(","):
            n = args.control_cuts if mode == "discard-flush" else args.cuts
            results[mode] = []
            for i in range(n):
                delay = rng.uniform(0.5, 4.0)
                t = time.monotonic()
                try:
                    cut = run_journal_cut(image, model, mode, delay)
                except HarnessError as exc:  # e.g. the daemon did not come back: a failure
                    print(f"  {mode:13s} cut {i + 1:3d}/{n}: delay {delay:4.2f} s: FAILED: "
                          f"{exc}", file=sys.stderr, flush=True)
                    failures += 1
                    continue
                results[mode].append(cut)
                print(f"  {mode:13s} cut {i + 1:3d}/{n}: delay {delay:4.2f} s, acked "
                      f"{len(cut.acked):3d}, journaled tokens {cut.journaled_tokens:4d}, lost "
                      f"acked {len(cut.lost_acked):3d}, unfinished {len(cut.unfinished):3d}, "
                      f"changed {len(cut.changed):3d}, integrity "
                      f"{'ok' if cut.integrity_ok else cut.before.get('integrity')} "
                      f"({time.monotonic() - t:.1f} s)"
                      + (f"; unfinished states {sorted(set(cut.unfinished_states.values()))}"
                         if cut.unfinished else ""), file=sys.stderr, flush=True)
    print(f"\n{'mode':13s} {'cuts':>5s} {'acked':>6s} {'tokens':>7s} {'lost acked':>11s} "
          f"{'unfinished':>11s} {'changed':>8s} {'integrity':>10s} {'s/cut':>6s}")
    ok = failures == 0
    for mode, cuts in results.items():
        if not cuts:
            continue
        lost = sum(len(c.lost_acked) for c in cuts)
        bad_integrity = sum(1 for c in cuts if c.before.get("exists") and not c.integrity_ok)
        unfinished = sum(len(c.unfinished) for c in cuts)
        changed = sum(len(c.changed) for c in cuts)
        per_cut = statistics.median(c.facts["boot1_s"] + c.facts["boot2_s"] for c in cuts)
        print(f"{mode:13s} {len(cuts):5d} {sum(len(c.acked) for c in cuts):6d} "
              f"{sum(c.journaled_tokens for c in cuts):7d} {lost:11d} {unfinished:11d} "
              f"{changed:8d} {('ok' if not bad_integrity else f'{bad_integrity} bad'):>10s} "
              f"{per_cut:6.1f}")
        if mode == "discard-flush":
            ok = ok and all(c.lost_acked for c in cuts)
        else:
            ok = ok and not (lost or unfinished or changed or bad_integrity)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("journal", "records"), default="journal")
    ap.add_argument("--cuts", type=int, default=20, help="power cuts per mode (default 20)")
    ap.add_argument("--control-cuts", type=int, default=3,
                    help="journal workload: cuts of the discard-flush control (default 3)")
    ap.add_argument("--boots", type=int, default=5, help="plain boots to time (default 5)")
    ap.add_argument("--modes", default=None,
                    help="default: writeback,discard-flush (journal); "
                         "writeback,discard-flush,plain (records)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the cut delays")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    if args.modes is None:
        args.modes = ("writeback,discard-flush" if args.workload == "journal"
                      else "writeback,discard-flush,plain")

    t0 = time.monotonic()
    image = arm64_image()
    print(f"guest image ready in {time.monotonic() - t0:.1f} s ({image.folder.name})")
    if args.boots:
        boots, walls = measure_boots(args.boots)
        print(f"boot to userspace: median {statistics.median(boots):.2f} s "
              f"(min {min(boots):.2f}, max {max(boots):.2f}); QEMU start to power-off "
              f"for `true`: median {statistics.median(walls):.2f} s over {args.boots} boots")

    if args.workload == "journal":
        ok = journal_bench(args, rng)
        print("verdict:", "OK" if ok else "FAILED (see the table: a mode did not behave)")
        return 0 if ok else 1

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
