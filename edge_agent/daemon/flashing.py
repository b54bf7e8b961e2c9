"""Flash jobs run by the daemon on ports it owns (POST /v1/flash, GET /v1/flash/{id}).

Invariants owned here:
- A request names nothing on the daemon's side: the ELF comes as bytes (`elf_base64`; a path
  field `elf` is refused), the board as a profile name from `firmware_tools.profiles`
  (`list_profiles()`; no path, no .toml file), the port as one of the owned port strings.
- The daemon flashes only ports it owns: `flash.ports` plus every `serial.port`, compared as
  exact strings, so a client cannot add options or simulator knobs to an owned URL. Any other
  port is refused (409 port_not_owned): the CLI flashes those directly.
- At most one job per board at a time (409 port_busy; the busy key is
  `firmware_tools.flasher.port_identity`). A UART transport holding the port is closed for the
  job and started again after it, whatever the outcome.
- An upload is at most `upload_limit()` (the largest flash among the MCU profiles plus
  ELF_OVERHEAD) and must start with the ELF magic; it is written to
  `<state_dir>/flash/uploads/<job id>.elf` (directory 0700, file 0600) only once the job is
  accepted, and deleted when the job ends, whatever the outcome. Leftovers (a daemon killed
  mid-job) are removed when the service starts. No error carries bytes of the upload.
- The ELF passes the flasher's own checks against the board (`firmware_tools.image.elf_image`,
  in a worker thread) before anything is stored: a rejected one is InvalidRequest (400)
  naming "the uploaded ELF", and no job exists.
- `flash_elf` runs in a worker thread; the event loop never blocks on the bootloader. Progress
  crosses back with `call_soon_threadsafe`; only the loop thread touches jobs and the journal.
- With the journal enabled a job is a `flash_jobs` row (an interrupted job of the same image,
  board and port is continued with resume): its sectors follow the flasher's own per-sector
  progress file, forward only, and all become `verified` when the job succeeds. Without the
  journal, jobs live in memory only (the flasher's progress file still allows --resume).
- `FlashService` gets only what it uses (the composition root, daemon/app.py, wires it): the
  state directory, the owned ports, the body limit, `stopping`, the journal's flash store when
  open, and the UART transports to pause (`PortUsers`). Refusals are domain errors
  (edge_agent/errors.py: ShuttingDown, PortNotOwned, FlashBusy, FlashJobNotFound,
  BoardProfileError, UploadFailed) that the edges map; only `parse_flash_request`, the parser
  of the HTTP body, speaks in ApiError 400/413 as protocol/api.py's parsers do.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent.errors import (
    UPLOADED_ELF,
    BoardProfileError,
    ConfigError,
    FlashBusy,
    FlashJobNotFound,
    InvalidRequest,
    PortNotOwned,
    ShuttingDown,
    UploadFailed,
)
from edge_agent.protocol.api import ApiError
from edge_agent.protocol.api import field_error as _bad

if TYPE_CHECKING:
    from edge_agent.journal.flashjobs import FlashJobs

__all__ = ["FlashService", "FlashJobRecord", "parse_flash_request", "FlashRequest", "PortUsers"]

log = logging.getLogger(__name__)

KEEP_FINISHED = 32
_FIELDS = ("elf_base64", "board", "port", "baud", "dry_run", "resume", "go")
ELF_MAGIC = b"\x7fELF"
ELF_OVERHEAD = 1 << 20  # ELF headers, symbols and debug sections on top of the flash image
FLASH_JSON_BYTES = 64 << 10  # a POST /v1/flash body's fields around its base64 ELF
FLASH_STOP_S = 10.0  # at shutdown: a stopped job's worker ends within one block's round trip
_BODY_SHAPE = '{"elf_base64": ..., "board": ..., "port": ...}'


@dataclass(frozen=True)
class FlashRequest:
    board: str
    port: str
    elf_bytes: bytes
    baud: int | None = None
    dry_run: bool = False
    resume: bool = False
    go: bool = True


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n % (1 << 20) == 0 else f"{n // 1024} KiB"


def upload_limit() -> tuple[int, str]:
    """The largest ELF the daemon takes, and why: the largest flash among the MCU profiles
    plus ELF_OVERHEAD (profiles that do not load are left out)."""
    from firmware_tools.errors import FirmwareError
    from firmware_tools.profiles import list_profiles, load_profile, profile_dir

    largest, name = 0, ""
    for board in list_profiles():
        try:
            size = load_profile(profile_dir() / f"{board}.toml").flash_size
        except (FirmwareError, OSError):
            continue
        if size > largest:
            largest, name = size, board
    why = (f"the largest flash of the board profiles ({_size(largest)}, {name}) plus "
           f"{_size(ELF_OVERHEAD)} for ELF headers, symbols and debug sections")
    return largest + ELF_OVERHEAD, why


def parse_flash_request(body: bytes, *, boards: Sequence[str],
                        max_elf_bytes: int, limit_why: str = "") -> FlashRequest:
    """Validate a POST /v1/flash body against the known board names and the upload limit
    (pure). ApiError 400 names the field; 413 elf_too_large says the limit."""
    try:
        d = json.loads(body or b"null")
    except RecursionError:  # arrays nested thousands deep: the decoder's stack, not a bug
        raise ApiError(400, "invalid_request", "request body: JSON arrays/objects nested far "
                       f"deeper than this request's fields need. Hint: send {_BODY_SHAPE}.") \
            from None
    except ValueError as exc:
        raise ApiError(400, "malformed_json", f"request body is not JSON ({exc}). Hint: send "
                       f"{_BODY_SHAPE}.") from exc
    if not isinstance(d, dict):
        raise ApiError(400, "invalid_request", "request body must be a JSON object. Hint: send "
                       f"{_BODY_SHAPE}.")
    if "elf" in d:
        raise _bad("elf", "the daemon does not read files named by a request, so a path is "
                   "refused", "send the file's bytes, base64-encoded, as elf_base64 "
                   "(`edge-agent flash FW.ELF --port PORT` does this)")
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise _bad(unknown[0], "unknown field", f"valid fields: {', '.join(_FIELDS)}")
    known = ", ".join(boards) or "(none)"
    for name in ("board", "port"):
        if not isinstance(d.get(name), str) or not d[name]:
            raise _bad(name, f"expected a non-empty string, got {json.dumps(d.get(name))}",
                       f"board: a profile name, one of {known}; port: one of the ports "
                       "GET /v1/flash/ports lists")
    board = d["board"]
    if any(sep in board for sep in ("/", "\\", os.sep)) or board not in boards:
        what = ("a path; boards are named, not read from files" if any(
            sep in board for sep in ("/", "\\", os.sep)) else "not a known board profile")
        raise _bad("board", f"{json.dumps(board)} is {what}", f"use one of: {known}")
    elf_bytes = _elf_bytes(d.get("elf_base64"), max_elf_bytes, limit_why)
    baud = d.get("baud")
    if baud is not None and (isinstance(baud, bool) or not isinstance(baud, int)
                             or not 50 <= baud <= 16_000_000):
        raise _bad("baud", f"expected an integer from 50 to 16000000, got {json.dumps(baud)}",
                   "leave it out for the board profile's baud rate")
    flags = {}
    for name, default in (("dry_run", False), ("resume", False), ("go", True)):
        value = d.get(name, default)
        if not isinstance(value, bool):
            raise _bad(name, f"expected true or false, got {json.dumps(value)}",
                       "use a JSON boolean")
        flags[name] = value
    return FlashRequest(board=board, port=d["port"], elf_bytes=elf_bytes, baud=baud, **flags)


def _elf_bytes(text: Any, limit: int, why: str) -> bytes:
    """The ELF from `elf_base64`: bounded, and starting with the ELF magic. Messages give
    sizes only, never the bytes."""
    if text is None:
        raise _bad("elf_base64", "missing", "send the ELF file's bytes, base64-encoded")
    if not isinstance(text, str):
        raise _bad("elf_base64", "expected a base64 string", "base64-encode the ELF file")

    def too_large(size: int) -> ApiError:
        return ApiError(413, "elf_too_large", f"field 'elf_base64': the ELF is {size} bytes, "
                        f"over the limit of {limit} bytes ({why or 'the upload limit'}). "
                        "Hint: check that this is the firmware ELF; strip its debug sections "
                        "(arm-none-eabi-strip -g) if it is.")

    if len(text) // 4 * 3 > limit + 3:  # refuse before decoding
        raise too_large(len(text) // 4 * 3)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad("elf_base64", f"not valid base64 ({exc})",
                   "base64-encode the ELF file (standard alphabet, padded)") from exc
    if len(data) > limit:
        raise too_large(len(data))
    if not data.startswith(ELF_MAGIC):
        raise _bad("elf_base64", f"the {len(data)} bytes are not an ELF file (they do not start "
                   "with the ELF magic 7f 45 4c 46)", "send the linker's ELF output (e.g. "
                   "build/fw.elf), not a .bin or .hex file")
    return data


@dataclass
class FlashJobRecord:
    id: str
    board: str
    port: str
    elf: str
    state: str = "queued"  # queued | running | done | failed
    phase: str = ""
    done: int = 0
    total: int = 0
    created: float = field(default_factory=time.time)
    finished_at: float | None = None
    result: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    warnings: list[str] = field(default_factory=list)
    journal_id: int | None = None
    elf_sha256: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "board": self.board, "port": self.port, "elf": self.elf,
                "state": self.state, "phase": self.phase,
                "progress": {"done": self.done, "total": self.total},
                "created": self.created, "finished_at": self.finished_at,
                "result": self.result, "error": self.error, "warnings": self.warnings,
                "journal_id": self.journal_id}


class PortUsers(Protocol):
    """What else holds the daemon's ports (daemon/uart_backend.py's `Uarts`): a flash job
    pauses the users of its board and resumes them after, whatever the outcome."""

    async def pause(self, same_board: Callable[[str], bool]) -> Sequence[Any]: ...

    async def resume(self, paused: Sequence[Any]) -> None: ...


class FlashService:
    def __init__(self, state_dir: Path, *, ports: Sequence[str], max_body_bytes: int,
                 stopping: Callable[[], bool], store: Callable[[], FlashJobs | None],
                 port_users: PortUsers) -> None:
        """`ports`: the owned ports (flash.ports, then serial.port); `store()`: the journal's
        flash jobs while the journal is open, else None."""
        self.state_dir = state_dir
        self.ports = list(dict.fromkeys(ports))
        self.max_body_bytes = max_body_bytes
        self.stopping = stopping
        self.store = store
        self.port_users = port_users
        self.jobs: OrderedDict[str, FlashJobRecord] = OrderedDict()
        self._busy: dict[str, str] = {}  # port identity -> job id
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._body_limit: int | None = None
        # set at shutdown when a job outlives the wait: its worker ends at the next block
        self._stop_flashing = threading.Event()
        self._remove_stale_uploads()

    @property
    def uploads(self) -> Path:
        return self.state_dir / "flash" / "uploads"

    # -- ownership ---------------------------------------------------------------------------
    def owned_ports(self) -> list[str]:
        return list(self.ports)

    def owns(self, port: str) -> bool:
        """Exactly one of the configured strings: no option or knob may be added to it."""
        return port in self.owned_ports()

    def same_board_as(self, port: str) -> str | None:
        """The owned port naming the same board as `port` with other options, if any."""
        from firmware_tools.flasher import port_identity

        ident = port_identity(port)
        return next((p for p in self.owned_ports() if port_identity(p) == ident), None)

    @staticmethod
    def check_ports(ports: Sequence[str]) -> None:
        """flash.ports at start: a URL pyserial cannot even parse (an unknown scheme) is a
        configuration error naming it (exit 78), not a job failure later. Nothing is opened:
        a device that is absent now may be plugged in before its first job."""
        if not ports:
            return
        import serial

        from firmware_tools.urlhandler import register

        register()  # stm32sim://
        for url in ports:
            try:
                serial.serial_for_url(url, do_not_open=True)
            except (ValueError, serial.SerialException) as exc:
                raise ConfigError(
                    f"flash.ports: {url!r}: pyserial cannot use it ({exc}). Hint: a device "
                    "path like /dev/ttyUSB0 or /dev/serial/by-id/..., or a URL like "
                    "socket://HOST:PORT, rfc2217://HOST:PORT or stm32sim://?chip=f405.") \
                    from None

    def body_limit(self) -> int:
        """The largest POST /v1/flash body: an ELF of `upload_limit()` bytes base64-encoded,
        plus room for the JSON around it; never below server.max_body_bytes. So a whole
        flash image is taken with the default server.max_body_bytes (1 MiB)."""
        if self._body_limit is None:
            encoded = 4 * -(-upload_limit()[0] // 3)
            self._body_limit = max(self.max_body_bytes, encoded + FLASH_JSON_BYTES)
        return self._body_limit

    def ports_info(self, port: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"ports": self.owned_ports(),
                               "max_body_bytes": self.body_limit(),
                               "max_elf_bytes": upload_limit()[0]}
        if port is not None:
            out["port"] = port
            out["owned"] = self.owns(port)
            if not out["owned"]:
                out["same_board_as"] = self.same_board_as(port)
        return out

    # -- jobs ----------------------------------------------------------------------------------
    def get(self, jid: str) -> FlashJobRecord:
        job = self.jobs.get(jid)
        if job is None:
            raise FlashJobNotFound(f"no flash job with id {jid!r} (unknown, or forgotten after "
                                   "it finished). Hint: use the id POST /v1/flash returned.",
                                   job_id=jid)
        return job

    def newest(self) -> dict[str, Any] | None:
        """A summary of the newest job (the UART `status`), or None."""
        if not self.jobs:
            return None
        job = next(reversed(self.jobs.values())).to_dict()
        keep = ("id", "board", "port", "state", "phase", "progress", "error")
        return {k: job.get(k) for k in keep if job.get(k) is not None}

    def parse(self, body: bytes) -> FlashRequest:
        """parse_flash_request with the board names and upload limit of this moment."""
        from firmware_tools.profiles import list_profiles

        limit, why = upload_limit()
        return parse_flash_request(body, boards=list_profiles(), max_elf_bytes=limit,
                                   limit_why=why)

    async def submit(self, req: FlashRequest) -> FlashJobRecord:
        """Accept a job: the refusals below, then the ELF's own checks against the board (in
        a worker thread; an ELF they reject is a 400 naming "the uploaded ELF", no job),
        then the refusals again (the daemon may have started stopping, another job taken
        the port, meanwhile), and only then the upload is stored and the job started."""
        from firmware_tools.image import ElfImageError, elf_image

        _, profile = self._admit(req)
        try:
            await asyncio.to_thread(elf_image, UPLOADED_ELF, req.elf_bytes, profile)
        except ElfImageError as exc:
            raise InvalidRequest(f"field 'elf_base64': {exc}") from None
        ident, profile = self._admit(req)
        jid = f"flash-{next(self._ids)}-{int(time.time())}"
        upload = self._write_upload(jid, req.elf_bytes)
        try:
            job = FlashJobRecord(id=jid, board=profile.name, port=req.port, elf=str(upload))
            self.jobs[jid] = job
            self._busy[ident] = jid
            self._prune()
            task = asyncio.get_running_loop().create_task(self._run(job, req, profile, ident))
        except BaseException:
            self._busy.pop(ident, None)
            self.jobs.pop(jid, None)
            self._remove_upload(upload)
            raise
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def _admit(self, req: FlashRequest) -> tuple[str, Any]:
        """The refusals of `req` as things stand (stopping, a port not owned, a busy port, a
        profile that does not load); its port's busy key and its board profile otherwise."""
        from firmware_tools.errors import FirmwareError
        from firmware_tools.flasher import port_identity
        from firmware_tools.profiles import load_profile, profile_dir

        if self.stopping():
            raise ShuttingDown("the daemon is shutting down. Hint: retry when it is back, or "
                               "flash directly.", retry_after_s=5)
        if not self.owns(req.port):
            owned = self.owned_ports()
            same = self.same_board_as(req.port)
            why = (f"; it names the board of owned port {same!r} with other options, and a "
                   "request may not change an owned port's options" if same else "")
            raise PortNotOwned(f"port {req.port!r} is not one the daemon owns (owned, compared "
                               f"as exact strings: {', '.join(repr(p) for p in owned) or 'none'})"
                               f"{why}. Hint: send one of the owned ports exactly as listed, "
                               "flash other ports directly (edge-agent flash --local), or add "
                               "the port to flash.ports in the daemon's configuration.",
                               port=req.port, same_board_as=same)
        ident = port_identity(req.port)
        if ident in self._busy:
            busy = self._busy[ident]
            raise FlashBusy(f"port {req.port!r} is busy with flash job {busy}. Hint: wait for it "
                            f"(GET /v1/flash/{busy}), then retry.", port=req.port, job_id=busy,
                            retry_after_s=5)
        try:  # a name parse_flash_request found in list_profiles(): never a path of the request
            profile = load_profile(profile_dir() / f"{req.board}.toml")
        except (FirmwareError, OSError) as exc:
            raise BoardProfileError(f"field 'board': {exc}. Hint: fix the profile file, or use "
                                    "another board", board=req.board) from exc
        return ident, profile

    # -- uploads -------------------------------------------------------------------------------
    def _write_upload(self, jid: str, data: bytes) -> Path:
        """`<uploads>/<jid>.elf`, 0600 in a 0700 directory, created afresh (never followed
        through a link). The caller deletes it when the job ends."""
        path = self.uploads / f"{jid}.elf"
        try:
            self.uploads.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.uploads, 0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise UploadFailed(f"cannot store the {len(data)}-byte ELF in {self.uploads} "
                               f"({exc.strerror or exc}). Hint: free space in the daemon's state "
                               "directory (server.state_dir), then retry.") from exc
        return path

    def _remove_upload(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning(f"cannot delete the flash upload {path} "
                        f"({exc.strerror or exc}); it is removed at the next start")

    def _remove_stale_uploads(self) -> None:
        """Uploads of jobs a killed daemon never finished: nothing can use them any more."""
        try:
            stale = [p for p in self.uploads.iterdir() if not p.is_dir()]
        except OSError:
            return  # no uploads directory yet
        for path in stale:
            self._remove_upload(path)
        if stale:
            log.info(f"flash: removed {len(stale)} upload(s) left by an earlier run in "
                     f"{self.uploads}")

    async def wait(self, timeout: float) -> None:
        """Let running jobs finish (shutdown); a flash is not cut half-way if avoidable. One
        still running after `timeout` stops at its next block, and is waited for: its worker
        thread is done before the journal closes, and the flasher's progress file says which
        sectors are verified, so `--resume` finishes it."""
        if not self._tasks:
            return
        running = ", ".join(j.id for j in self.jobs.values() if j.state in ("queued", "running"))
        log.info(f"flash: waiting up to {timeout:.0f} s for flash job(s) {running} to finish")
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        if pending:
            self._stop_flashing.set()
            log.warning(f"flash: job(s) {running} still running as the daemon stops: stopped "
                        "at the next block; flash again with --resume to finish them")
            await asyncio.wait(pending, timeout=FLASH_STOP_S)

    def _prune(self) -> None:
        finished = [k for k, j in self.jobs.items() if j.state in ("done", "failed")]
        for k in finished[:max(0, len(finished) - KEEP_FINISHED)]:
            del self.jobs[k]

    # -- running a job -------------------------------------------------------------------------
    async def _run(self, job: FlashJobRecord, req: FlashRequest, profile: Any,
                   ident: str) -> None:
        from firmware_tools.errors import FlashError

        loop = asyncio.get_running_loop()
        paused: Sequence[Any] = ()
        try:
            paused = await self._pause_uart(ident)
            job.state = "running"
            self._touch(job)
            await self._journal_start(job, profile, req.resume)
            state_dir = self.state_dir

            def progress(done: int, total: int, phase: str = "") -> None:
                if self._stop_flashing.is_set():  # the daemon stops: end at this block
                    raise FlashError(
                        f"flash job {job.id}: the daemon stopped before the flash finished "
                        f"({phase} {done} of {total} bytes). Hint: flash again with --resume "
                        "(POST /v1/flash with \"resume\": true) once it is back: the "
                        "verified sectors are kept.")
                loop.call_soon_threadsafe(self._progress, job, done, total, phase)

            def sector(indexes: list[int], state: str) -> None:
                loop.call_soon_threadsafe(self._sector, job, indexes, state)

            from firmware_tools.flasher import flash_elf

            result = await asyncio.to_thread(
                flash_elf, job.elf, profile, req.port, baud=req.baud, dry_run=req.dry_run,
                resume=req.resume, go=req.go, progress=progress, state_dir=state_dir,
                on_sector=sector)
        except Exception as exc:  # noqa: BLE001 - every failure is the job's answer
            job.state = "failed"
            # the daemon's copy of the ELF is gone with the job and means nothing to a client
            job.error = {"code": type(exc).__name__,
                         "message": str(exc).replace(job.elf, UPLOADED_ELF)}
            self._journal_end(job, profile, ok=False)
            log.error(f"flash {job.id}: {job.elf} to {job.board} on {job.port} failed: {exc}")
        else:
            job.result = result.to_dict()
            job.warnings = list(result.warnings)
            job.state = "done"
            job.phase = "done"
            job.done = job.total = max(job.total, result.size)
            self._journal_end(job, profile, ok=True)
            log.info(f"flash {job.id}: {job.elf} to {job.board} on {job.port}: done "
                     f"({result.bytes_written} bytes written, {result.bytes_verified} "
                     f"verified, {result.seconds:.1f} s)")
        finally:
            job.finished_at = time.time() if job.state in ("done", "failed") else None
            self._remove_upload(Path(job.elf))
            self._busy.pop(ident, None)
            await self._resume_uart(paused)
            self._touch(job)

    def _progress(self, job: FlashJobRecord, done: int, total: int, phase: str) -> None:
        job.done, job.total, job.phase = done, total, phase
        self._touch(job)

    def _sector(self, job: FlashJobRecord, indexes: list[int], state: str) -> None:
        """Per-sector progress journaled live (flash_jobs/flash_sectors), forward only."""
        store = self._flash_store()
        if store is None or job.journal_id is None:
            return
        try:
            current = store.get(job.journal_id)
            rank = {"pending": 0, "erased": 1, "written": 2, "verified": 3}
            have = {s.sector: s.state for s in current.sectors} if current else {}
            forward = [i for i in indexes if rank.get(have.get(i, ""), -1) < rank[state]]
            if forward:
                store.mark(job.journal_id, forward, state)
        except Exception as exc:  # noqa: BLE001 - the journal must not stop the flash
            log.warning(f"flash {job.id}: journal sector update failed: {exc}")

    def _touch(self, job: FlashJobRecord) -> None:
        job.changed.set()
        job.changed = asyncio.Event()

    # -- journal -------------------------------------------------------------------------------
    def _flash_store(self) -> FlashJobs | None:
        return self.store()

    async def _journal_start(self, job: FlashJobRecord, profile: Any, resume: bool) -> None:
        store = self._flash_store()
        if store is None:
            return
        from firmware_tools.flasher import port_identity, sector_jobs
        from firmware_tools.image import load_elf

        image = await asyncio.to_thread(load_elf, job.elf, profile)  # fast; off the loop
        job.elf_sha256 = image.sha256
        port = port_identity(job.port)
        old = store.resumable(image.sha256, profile.name, port) if resume else None
        if old is not None:
            job.journal_id = old.id
            return
        sectors = [(j.sector.index, j.sector.start, j.sector.size)
                   for j in sector_jobs(image, profile)]
        job.journal_id = store.create(image.sha256, profile.name, port, sectors)

    def _journal_end(self, job: FlashJobRecord, profile: Any, *, ok: bool) -> None:
        store = self._flash_store()
        if store is None or job.journal_id is None:
            return
        try:
            current = store.get(job.journal_id)
            indexes = [s.sector for s in current.sectors] if current else []
            if ok:
                store.mark(job.journal_id, indexes, "verified")
                store.finish(job.journal_id, "done")
            else:
                self._copy_flasher_progress(job, profile, store)
                store.finish(job.journal_id, "failed", (job.error or {}).get("message"))
        except Exception as exc:  # noqa: BLE001 - the journal must not hide the job's result
            log.warning(f"flash {job.id}: journal update failed: {exc}")

    def _copy_flasher_progress(self, job: FlashJobRecord, profile: Any, store: Any) -> None:
        """Sector states of a failed job, from the flasher's own progress file."""
        from firmware_tools.flasher import journal_path

        if job.elf_sha256 is None:
            return
        path = journal_path(self.state_dir, job.elf_sha256, profile.name, job.port)
        with contextlib.suppress(OSError, ValueError):
            sectors = json.loads(path.read_text()).get("sectors", {})
            for state in ("erased", "written", "verified"):
                picked = [int(i) for i, s in sectors.items() if s == state]
                if picked:
                    with contextlib.suppress(Exception):
                        store.mark(job.journal_id, picked, state)

    # -- the UART transport on the same port ----------------------------------------------------
    async def _pause_uart(self, ident: str) -> Sequence[Any]:
        from firmware_tools.flasher import port_identity

        return await self.port_users.pause(lambda url: port_identity(url) == ident)

    async def _resume_uart(self, paused: Sequence[Any]) -> None:
        if paused and not self.stopping():
            await self.port_users.resume(paused)
