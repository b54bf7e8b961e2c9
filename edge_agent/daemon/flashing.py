"""Flash jobs run by the daemon on ports it owns (POST /v1/flash, GET /v1/flash/{id}).

Invariants owned here:
- The daemon flashes only ports it owns: `flash.ports` plus every `serial.port`, compared by
  `firmware_tools.flasher.port_identity` (fault knobs and options of a URL do not matter). Any
  other port is refused (409 port_not_owned): the CLI flashes those directly.
- At most one job per port at a time (409 port_busy). A UART transport holding the port is
  closed for the job and started again after it, whatever the outcome.
- `flash_elf` runs in a worker thread; the event loop never blocks on the bootloader. Progress
  crosses back with `call_soon_threadsafe`; only the loop thread touches jobs and the journal.
- With the journal enabled a job is a `flash_jobs` row (an interrupted job of the same image,
  board and port is continued with resume): its sectors follow the flasher's own per-sector
  progress file, forward only, and all become `verified` when the job succeeds. Without the
  journal, jobs live in memory only (the flasher's progress file still allows --resume).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import itertools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_agent.protocol.api import ApiError

if TYPE_CHECKING:
    from edge_agent.daemon.app import Daemon

__all__ = ["FlashService", "FlashJobRecord", "parse_flash_request", "FlashRequest"]

KEEP_FINISHED = 32
_FIELDS = ("elf", "elf_base64", "board", "port", "baud", "dry_run", "resume", "go")


@dataclass(frozen=True)
class FlashRequest:
    board: str
    port: str
    elf: str | None = None
    elf_bytes: bytes | None = None
    baud: int | None = None
    dry_run: bool = False
    resume: bool = False
    go: bool = True


def _bad(field_name: str, problem: str, hint: str) -> ApiError:
    return ApiError(400, "invalid_request", f"field {field_name!r}: {problem}. Hint: {hint}")


def parse_flash_request(body: bytes) -> FlashRequest:
    """Validate a POST /v1/flash body (pure). ApiError 400 names the field."""
    try:
        d = json.loads(body or b"null")
    except ValueError as exc:
        raise ApiError(400, "malformed_json", f"request body is not JSON ({exc}). Hint: send "
                       '{"elf_base64": ..., "board": ..., "port": ...}.') from exc
    if not isinstance(d, dict):
        raise ApiError(400, "invalid_request", "request body must be a JSON object. Hint: send "
                       '{"elf_base64": ..., "board": ..., "port": ...}.')
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise _bad(unknown[0], "unknown field", f"valid fields: {', '.join(_FIELDS)}")
    for name in ("board", "port"):
        if not isinstance(d.get(name), str) or not d[name]:
            raise _bad(name, f"expected a non-empty string, got {json.dumps(d.get(name))}",
                       "board: an MCU profile name (e.g. stm32f405); port: a pyserial URL")
    has_path, has_bytes = d.get("elf") is not None, d.get("elf_base64") is not None
    if has_path == has_bytes:
        raise _bad("elf", "give exactly one of 'elf' (a path the daemon can read) and "
                   "'elf_base64' (the file's bytes)", "the CLI sends elf_base64")
    elf_bytes = None
    if has_path and (not isinstance(d["elf"], str) or not d["elf"].startswith("/")):
        raise _bad("elf", f"expected an absolute path, got {json.dumps(d['elf'])}",
                   "the daemon's working directory is not yours; send an absolute path")
    if has_bytes:
        if not isinstance(d["elf_base64"], str):
            raise _bad("elf_base64", "expected a base64 string", "base64-encode the ELF file")
        try:
            elf_bytes = base64.b64decode(d["elf_base64"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _bad("elf_base64", f"not valid base64 ({exc})",
                       "base64-encode the ELF file (standard alphabet, padded)") from exc
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
    return FlashRequest(board=d["board"], port=d["port"], elf=d.get("elf"),
                        elf_bytes=elf_bytes, baud=baud, **flags)


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


class FlashService:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.jobs: OrderedDict[str, FlashJobRecord] = OrderedDict()
        self._busy: dict[str, str] = {}  # port identity -> job id
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- ownership ---------------------------------------------------------------------------
    def owned_ports(self) -> list[str]:
        from edge_agent.daemon.uart_backend import serial_ports

        flash_cfg = getattr(self.d.config, "flash", None)
        extra = flash_cfg.port_list() if flash_cfg is not None else []
        return list(dict.fromkeys([*extra, *serial_ports(self.d.config)]))

    def owns(self, port: str) -> bool:
        from firmware_tools.flasher import port_identity

        return port_identity(port) in {port_identity(p) for p in self.owned_ports()}

    def ports_info(self, port: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"ports": self.owned_ports(),
                               "max_body_bytes": int(self.d.config.server.max_body_bytes)}
        if port is not None:
            out["port"] = port
            out["owned"] = self.owns(port)
        return out

    # -- jobs ----------------------------------------------------------------------------------
    def get(self, jid: str) -> FlashJobRecord:
        job = self.jobs.get(jid)
        if job is None:
            raise ApiError(404, "flash_job_not_found", f"no flash job with id {jid!r} (unknown, "
                           "or forgotten after it finished). Hint: use the id POST /v1/flash "
                           "returned.")
        return job

    def submit(self, req: FlashRequest) -> FlashJobRecord:
        from firmware_tools.errors import FirmwareError
        from firmware_tools.flasher import port_identity
        from firmware_tools.profiles import load_profile

        if self.d.stopping:
            raise ApiError(503, "shutting_down", "the daemon is shutting down. Hint: retry when "
                           "it is back, or flash directly.", headers=[("retry-after", "5")])
        if not self.owns(req.port):
            raise ApiError(409, "port_not_owned", f"port {req.port!r} is not one the daemon "
                           f"owns (owned: {', '.join(self.owned_ports()) or 'none'}). Hint: "
                           "flash it directly (edge-agent flash --local), or add it to "
                           "flash.ports in the daemon's configuration.")
        ident = port_identity(req.port)
        if ident in self._busy:
            raise ApiError(409, "port_busy", f"port {req.port!r} is busy with flash job "
                           f"{self._busy[ident]}. Hint: wait for it (GET /v1/flash/"
                           f"{self._busy[ident]}), then retry.", headers=[("retry-after", "5")])
        try:
            profile = load_profile(req.board)
        except (FirmwareError, OSError) as exc:
            raise _bad("board", str(exc), "use a profile name from board_profiles/") from exc
        elf = req.elf or ""
        if req.elf_bytes is not None:
            digest = hashlib.sha256(req.elf_bytes).hexdigest()
            upload = self.d.state_dir / "flash" / "uploads" / f"{digest[:20]}.elf"
            upload.parent.mkdir(parents=True, exist_ok=True)
            tmp = upload.with_suffix(".tmp")
            tmp.write_bytes(req.elf_bytes)
            tmp.replace(upload)
            elf = str(upload)
        elif not Path(elf).is_file():
            raise _bad("elf", f"{elf}: no such file for the daemon",
                       "send the bytes as elf_base64 instead")
        jid = f"flash-{next(self._ids)}-{int(time.time())}"
        job = FlashJobRecord(id=jid, board=profile.name, port=req.port, elf=elf)
        self.jobs[jid] = job
        self._busy[ident] = jid
        self._prune()
        task = asyncio.get_running_loop().create_task(self._run(job, req, profile, ident))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def wait(self, timeout: float) -> None:
        """Let running jobs finish (shutdown); a flash is not cut half-way if avoidable."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    def _prune(self) -> None:
        finished = [k for k, j in self.jobs.items() if j.state in ("done", "failed")]
        for k in finished[:max(0, len(finished) - KEEP_FINISHED)]:
            del self.jobs[k]

    # -- running a job -------------------------------------------------------------------------
    async def _run(self, job: FlashJobRecord, req: FlashRequest, profile: Any,
                   ident: str) -> None:
        loop = asyncio.get_running_loop()
        paused = await self._pause_uart(ident)
        try:
            job.state = "running"
            self._touch(job)
            await self._journal_start(job, profile, req.resume)
            state_dir = self.d.state_dir

            def progress(done: int, total: int, phase: str = "") -> None:
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
            job.error = {"code": type(exc).__name__, "message": str(exc)}
            self._journal_end(job, profile, ok=False)
            self.d.log(f"flash {job.id}: {job.elf} to {job.board} on {job.port} failed: {exc}")
        else:
            job.result = result.to_dict()
            job.warnings = list(result.warnings)
            job.state = "done"
            job.phase = "done"
            job.done = job.total = max(job.total, result.size)
            self._journal_end(job, profile, ok=True)
            self.d.log(f"flash {job.id}: {job.elf} to {job.board} on {job.port}: done "
                       f"({result.bytes_written} bytes written, {result.bytes_verified} "
                       f"verified, {result.seconds:.1f} s)")
        finally:
            job.finished_at = time.time() if job.state in ("done", "failed") else None
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
            self.d.log(f"warning: flash {job.id}: journal sector update failed: {exc}")

    def _touch(self, job: FlashJobRecord) -> None:
        job.changed.set()
        job.changed = asyncio.Event()

    # -- journal -------------------------------------------------------------------------------
    def _flash_store(self) -> Any:
        journal = getattr(self.d, "journal", None)
        store = getattr(journal, "store", None)
        return getattr(store, "flash", None)

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
            self.d.log(f"warning: flash {job.id}: journal update failed: {exc}")

    def _copy_flasher_progress(self, job: FlashJobRecord, profile: Any, store: Any) -> None:
        """Sector states of a failed job, from the flasher's own progress file."""
        from firmware_tools.flasher import journal_path

        if job.elf_sha256 is None:
            return
        path = journal_path(self.d.state_dir, job.elf_sha256, profile.name, job.port)
        with contextlib.suppress(OSError, ValueError):
            sectors = json.loads(path.read_text()).get("sectors", {})
            for state in ("erased", "written", "verified"):
                picked = [int(i) for i, s in sectors.items() if s == state]
                if picked:
                    with contextlib.suppress(Exception):
                        store.mark(job.journal_id, picked, state)

    # -- the UART transport on the same port ----------------------------------------------------
    async def _pause_uart(self, ident: str) -> list[Any]:
        from firmware_tools.flasher import port_identity

        paused = []
        for t in list(getattr(self.d, "uarts", [])):
            settings = getattr(getattr(t, "link", None), "settings", None)
            if settings is not None and port_identity(settings.url) == ident:
                self.d.log(f"flash: closing the UART transport on {settings.url} for the job")
                await t.close()
                self.d.uarts.remove(t)
                paused.append(settings)
        return paused

    async def _resume_uart(self, paused: list[Any]) -> None:
        if not paused or self.d.stopping:
            return
        from edge_agent.daemon.uart_backend import DaemonBackend
        from edge_agent.transports.uart import UartTransport

        cfg = self.d.config.serial
        for settings in paused:
            t = UartTransport(settings, DaemonBackend(self.d), echo=cfg.echo,
                              max_line=cfg.max_line, mode=cfg.mode, log=self.d.log)
            try:
                await t.start()
            except Exception as exc:  # noqa: BLE001 - the daemon keeps running without it
                self.d.log(f"warning: UART transport on {settings.url} did not restart after "
                           f"flashing: {exc}")
                continue
            self.d.uarts.append(t)
