"""Flash an ELF through the STM32 UART bootloader: check, read-before-erase, write, verify, resume.

Invariants this module owns:
- Nothing is written unless the ELF passed every check (`load_elf`) and the chip id matches the
  board profile.
- Only sectors the image covers are touched. A sector whose image bytes already read back equal
  is left alone (no erase, no write). Every other covered sector is erased (one erase command
  for all of them), written, then read back and compared (always; there is no switch to skip
  verification).
- Progress is kept per sector (firmware_tools/progress.py): `erased` after the erase ACK,
  `verified` after the read-back matched. `resume=True` skips `verified` sectors (and reads them
  back once at the end), continues an `erased` sector without erasing it again when its unwritten
  blocks still read 0xFF; without that job's progress it says so and reads before erasing.
- Go (jump to the image base) is sent only after everything verified.
- With `[reset] method = "dtr-rts"` or `"gpio"` the chip is reset into its bootloader through
  the adapter's modem lines or the host's GPIO lines before the sync, BOOT0 is released before
  Go (the next reset boots the image), and `read_flash` resets it back into its application
  when done (firmware_tools/reset_lines.py); GPIO lines are given back on every path.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from firmware_tools.bootloader import Bootloader, BootloaderTimeout, Timeouts, open_port
from firmware_tools.errors import FlashError
from firmware_tools.progress import SectorMarked, SectorProgress, journal_path, port_identity
from firmware_tools.reset_lines import ResetLines, open_levels

__all__ = [
    "FlashError",
    "FlashResult",
    "Progress",
    "VerifyError",
    "flash_elf",
    "journal_path",
    "port_identity",
    "SectorJob",
    "read_flash",
    "sector_jobs",
]

Progress = Callable[[int, int, str], None]
BLOCK = 256
PROBE = 16


class VerifyError(FlashError):
    """Read-back after writing differs from the image."""


@dataclass
class FlashResult:
    """What a flash job did; `to_dict()` is the `--json` output."""

    elf: str
    board: str
    port: str
    image_sha256: str
    base: int
    size: int
    sectors: list[int]
    dry_run: bool = False
    chip_id: int | None = None
    bootloader_version: str | None = None
    erase_command: int | None = None
    erased: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # already matched: untouched
    resumed: list[int] = field(default_factory=list)  # done by an earlier, interrupted run
    bytes_written: int = 0
    bytes_verified: int = 0
    went: bool = False
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    journal: str | None = None  # the progress file while it exists (None once the job is done)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["base"] = f"0x{self.base:08X}"
        if self.chip_id is not None:
            out["chip_id"] = f"0x{self.chip_id:03X}"
        if self.erase_command is not None:
            out["erase_command"] = f"0x{self.erase_command:02X}"
        return out


# --- what to write -------------------------------------------------------------------------


@dataclass(frozen=True)
class SectorJob:
    """One covered sector: `check` covers all its image bytes (blank blocks included, for
    read-before-erase and verify); `write` leaves out blocks that are all 0xFF."""

    sector: Any
    check: tuple[tuple[int, bytes], ...]
    write: tuple[tuple[int, bytes], ...]

    @property
    def size(self) -> int:
        return sum(len(d) for _, d in self.check)


def sector_jobs(image: Any, profile: Any) -> list[SectorJob]:
    """Split `image` along the plan's chunk grid (`firmware_tools.plan`) into per-sector jobs."""
    from firmware_tools.plan import plan_flash

    full = plan_flash(image, profile, skip_blank=False).write_chunks
    plan = plan_flash(image, profile)
    jobs = []
    for sector in plan.sectors:
        check = tuple(c for c in full if sector.start <= c[0] < sector.end)
        write = tuple(c for c in plan.write_chunks if sector.start <= c[0] < sector.end)
        jobs.append(SectorJob(sector, check, write))
    return jobs


# --- the job ---------------------------------------------------------------------------------


def _timeouts(profile: Any) -> Timeouts:
    b = profile.bootloader
    return Timeouts(
        ack=b.command_timeout_s,
        write=b.write_timeout_s,
        sector_erase=b.erase_timeout_s,
        mass_erase=b.mass_erase_timeout_s,
        read=max(b.command_timeout_s, 1.0),
    )


def _is_pty(port: str) -> bool:
    path = os.path.realpath(port) if os.path.exists(port) else port
    return path.startswith("/dev/pts/")


def _connect(
    profile: Any, port: Any, baud: int | None, parity: str | None, notes: list[str]
) -> tuple[Bootloader, ResetLines]:
    """The chip in its bootloader (reset into it through the profile's [reset] wiring when
    the port can), synced, its commands and id read and checked."""
    settings = profile.bootloader
    name = port if isinstance(port, str) else None
    if parity is None:
        parity = settings.parity
        if name and parity != "N" and _is_pty(name):
            # The kernel refuses PARENB on a pseudo-terminal (tcsetattr: EINVAL).
            parity = "N"
            notes.append(
                f"{name} is a pseudo-terminal, which has no parity: using 8N1 instead of the "
                f"bootloader's 8{settings.parity}1 (fine for a simulator or a bridge)"
            )
    levels = open_levels(profile.reset)
    handle = open_port(port, baud or settings.baud, parity, levels=levels) if name else port
    bl = Bootloader(
        handle, timeouts=_timeouts(profile), write_retries=settings.write_retries, name=name
    )
    lines = ResetLines(handle, profile.reset, bl.name)
    try:
        note = lines.enter_bootloader()
        if note:
            notes.append(note)
        try:
            bl.sync()
        except BootloaderTimeout as exc:
            if not lines.driven:
                raise
            raise BootloaderTimeout(
                f"{exc} This board profile ({profile.name}) reset the chip through "
                f"{lines.wiring()}; if the board is wired otherwise (other lines, an "
                "inverter), set reset_line, boot0_line, reset_invert and boot0_invert under "
                "[reset] in a copy of the profile, or method = \"manual\" to reset it by hand."
            ) from None
        bl.get()
        bl.check_chip(profile.chip_ids, profile.name)
    except BaseException:
        lines.close()
        if name:
            bl.close()
        else:
            bl.release()
        raise
    return bl, lines


def flash_elf(
    elf_path: str | os.PathLike[str],
    profile: Any,
    port_url: Any,
    *,
    baud: int | None = None,
    dry_run: bool = False,
    resume: bool = False,
    go: bool = True,
    progress: Progress | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    parity: str | None = None,
    on_sector: SectorMarked | None = None,
) -> FlashResult:
    """Check `elf_path` against `profile` and flash it through the bootloader at `port_url`.

    `port_url` is any pyserial URL (`/dev/ttyUSB0`, `socket://h:p`, `stm32sim://?chip=f405`) or
    an open port object. `dry_run` runs the checks and the plan only and opens no port.
    `parity` overrides the profile's (default: the profile's; 'N' on a pty, with a warning).
    `on_sector(indexes, state)` is called as sectors become erased, written and verified (from
    this thread; e.g. to journal per-sector progress live).
    """
    from firmware_tools.image import load_elf

    t0 = time.monotonic()
    image = load_elf(elf_path, profile)
    jobs = sector_jobs(image, profile)
    port_name = port_url if isinstance(port_url, str) else str(getattr(port_url, "name", "port"))
    result = FlashResult(
        elf=os.fspath(elf_path),
        board=profile.name,
        port=port_name,
        image_sha256=image.sha256,
        base=image.base,
        size=len(image.data),
        sectors=[j.sector.index for j in jobs],
        dry_run=dry_run,
        warnings=list(image.warnings),
    )
    if dry_run:
        result.seconds = time.monotonic() - t0
        return result
    if resume and state_dir is None:
        raise FlashError(
            "resume: no state directory to find the progress of the interrupted job in. "
            "Hint: pass state_dir (the CLI's --state-dir) as in the first run."
        )
    path = journal_path(state_dir, image.sha256, profile.name, port_name) if state_dir else None
    head = {"image_sha256": image.sha256, "board": profile.name, "port": port_identity(port_name)}
    journal = SectorProgress(path, head, resume, on_mark=on_sector)
    result.journal = str(path) if path else None
    if resume and not journal.loaded:
        result.warnings.append(
            f"resume: no progress of an interrupted job for this image, board and port in "
            f"{Path(state_dir or '.') / 'flash'} (started by the daemon or with another state "
            "directory, or on another port?): every sector is read first and those that "
            "already hold the image are skipped; the others are erased and written again"
        )
    total = sum(j.size for j in jobs)
    report = progress or (lambda done, total, phase: None)

    bl, lines = _connect(profile, port_url, baud, parity, result.warnings)
    try:
        assert bl.info is not None
        result.bootloader_version = bl.info.version_text
        result.chip_id = bl.chip_id
        erase_code = bl.erase_command()
        result.erase_command = erase_code
        # 1. Read before erase: decide for every covered sector.
        work: list[tuple[SectorJob, tuple[tuple[int, bytes], ...]]] = []
        done = 0
        for job in jobs:
            index = job.sector.index
            state = journal.state(index) if resume else None
            if state == "verified":
                result.resumed.append(index)
                continue
            todo = _sector_todo(bl, job, state, report, done, total)
            if todo is None:  # already holds the image
                result.skipped.append(index)
                journal.mark(index, "verified")
                done += job.size
                report(done, total, "skip")
            else:
                work.append((job, todo))
        # 2. One erase command for every sector that needs it (as stm32flash does).
        to_erase = [job.sector.index for job, todo in work if todo is job.write]
        if to_erase:
            report(done, total, "erase")
            bl.erase(to_erase, erase_code)
            result.erased.extend(to_erase)
            journal.mark_many(to_erase, "erased")
        # 3. Write and read back, sector by sector.
        def write_and_verify(job: SectorJob, todo: tuple[tuple[int, bytes], ...]) -> None:
            nonlocal done
            index, size = job.sector.index, job.size
            # Per-block bookkeeping runs while the next command is on the wire (_Steps).
            half = size // 2
            bl.write_blocks(todo, _Steps(result, True, todo, progress, done, half, total))
            if on_sector is not None:
                on_sector([index], "written")
            steps = _Steps(result, False, job.check, progress, done + half, size - half, total)
            _verify(bl, job.check, index, steps)
            journal.mark(index, "verified")
            done += size

        for job, todo in work:
            write_and_verify(job, todo)
        # 4. Sectors an interrupted run finished: read back once. One that no longer holds the
        #    image (written to since, by another tool or a program) is erased and written
        #    again now, not failed on every --resume.
        changed: list[SectorJob] = []
        for job in jobs:
            if job.sector.index in result.resumed:
                try:
                    _verify(bl, job.check, job.sector.index,
                            _Steps(result, False, job.check, None, done, 0, total))
                except VerifyError:
                    changed.append(job)
                    continue
                done += job.size
                report(done, total, "verify")
        if changed:
            indexes = [job.sector.index for job in changed]
            report(done, total, "erase")
            bl.erase(indexes, erase_code)
            result.erased.extend(indexes)
            result.resumed = [i for i in result.resumed if i not in indexes]
            journal.mark_many(indexes, "erased")
            for job in changed:
                write_and_verify(job, job.write)
        lines.release_boot0()  # the next reset boots the new image
        if go:
            bl.go(image.base)
            result.went = True
        journal.done()
        result.journal = None  # done: the progress file is gone, nothing to resume
        report(total, total, "done")
    finally:
        lines.close()
        if isinstance(port_url, str):
            bl.close()
        else:
            bl.release()  # the caller's port: give it back as it was opened
    result.seconds = time.monotonic() - t0
    return result


def _sector_todo(
    bl: Bootloader, job: SectorJob, state: str | None, report: Progress, done: int, total: int
) -> tuple[tuple[int, bytes], ...] | None:
    """None if the sector already holds the image; `job.write` itself if it must be erased
    and written; otherwise (resuming an erased sector) the blocks still to write."""
    if state != "erased":
        # Read before erase: a 16-byte probe first (a different image nearly always differs
        # there), then block by block; the first difference decides.
        address, data = job.check[0]
        report(done, total, "read")
        if bl.compare_blocks(((address, data[:PROBE]),)) is not None:
            return job.write
        if bl.compare_blocks(job.check, lambda i: report(done, total, "read")) is not None:
            return job.write
        return None
    missing: set[int] = set()
    for address, data in job.check:
        report(done, total, "read")
        current = bl.read_memory(address, len(data))
        if current == data:
            continue
        if current != b"\xff" * len(data):
            return job.write  # a half-programmed block: erase the sector again
        missing.add(address)
    todo = tuple(c for c in job.write if c[0] in missing)
    return todo or None


class _Steps:
    """Called with each block's index as it is done: counts its bytes into the result's
    bytes_written (`writing`) or bytes_verified, and reports progress from `at` to
    `at + span` in proportion to the bytes done."""

    def __init__(
        self,
        result: FlashResult,
        writing: bool,
        blocks: tuple[tuple[int, bytes], ...],
        report: Progress | None,
        at: int,
        span: int,
        total: int,
    ) -> None:
        self.result, self.writing, self.blocks = result, writing, blocks
        self.report, self.at, self.span, self.total = report, at, span, total
        self.ends = list(itertools.accumulate(len(d) for _, d in blocks)) or [1]
        self.phase = "write" if writing else "verify"

    def __call__(self, i: int) -> None:
        if self.writing:
            self.result.bytes_written += len(self.blocks[i][1])
        else:
            self.result.bytes_verified += len(self.blocks[i][1])
        if self.report is not None:
            done = self.at + self.ends[i] * self.span // self.ends[-1]
            self.report(done, self.total, self.phase)


def _verify(
    bl: Bootloader, blocks: tuple[tuple[int, bytes], ...], sector: int, steps: _Steps
) -> None:
    """Read every block back and compare (`steps` after each block that matched)."""
    bad = bl.compare_blocks(blocks, steps)
    if bad is not None:
        index, got = bad
        address, data = blocks[index]
        i = next(i for i, (a, b) in enumerate(zip(got, data, strict=True)) if a != b)
        raise VerifyError(
            f"verify of sector {sector} on {bl.name}: byte at 0x{address + i:08X} reads "
            f"0x{got[i]:02X}, wrote 0x{data[i]:02X}. Hint: run the flash again; if the same "
            "address fails twice the flash cell is worn or the sector is write-protected "
            "(Write Unprotect 0x73)."
        )


def read_flash(
    profile: Any,
    port_url: Any,
    out_path: str | os.PathLike[str],
    *,
    baud: int | None = None,
    address: int | None = None,
    length: int | None = None,
    progress: Progress | None = None,
    parity: str | None = None,
    notes: list[str] | None = None,
) -> int:
    """Dump [address, address+length) (default: the whole flash) to `out_path`; returns bytes.

    The output file is opened (as `out_path`.tmp) before the board is: a path that cannot be
    written fails at once, not after minutes of reading. `notes` gets what the connection
    changed (8N1 on a pty)."""
    start = profile.flash_start if address is None else address
    size = (profile.flash_end - start) if length is None else length
    if size <= 0:
        raise FlashError(
            f"read of {size} bytes at 0x{start:08X}: nothing to read. "
            "Hint: pass a positive --length or an address inside flash."
        )
    out = Path(out_path)
    tmp = out.with_name(out.name + ".tmp")
    if out.is_dir():
        raise FlashError(f"dump file {str(out)!r} is a directory. Hint: name a file in it, "
                         f"e.g. --out {str(out / 'flash.bin')!r}.")
    try:
        fh = open(tmp, "wb")  # noqa: SIM115  # closed below on every path
    except OSError as exc:
        raise FlashError(f"dump file {str(out)!r} cannot be written: {exc.strerror} "
                         f"({str(tmp)!r}). Hint: name a file in an existing directory you may "
                         "write.") from exc
    done = False
    try:
        bl, lines = _connect(profile, port_url, baud, parity,
                             notes if notes is not None else [])
        buf = bytearray()
        try:
            while len(buf) < size:
                n = min(BLOCK, size - len(buf))
                buf += bl.read_memory(start + len(buf), n)
                if progress:
                    progress(len(buf), size, "read")
            lines.run_application()  # back to what it ran, when the lines brought it here
        finally:
            lines.close()
            if isinstance(port_url, str):
                bl.close()
            else:
                bl.release()  # the caller's port: give it back as it was opened
        fh.write(buf)
        fh.flush()
        os.fsync(fh.fileno())
        done = True
    finally:
        fh.close()
        if not done:
            tmp.unlink(missing_ok=True)
    os.replace(tmp, out)
    return len(buf)
