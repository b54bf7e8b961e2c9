"""A serial port for asyncio: opened by URL, reads never block the loop, reopened when it vanishes.

Invariants owned here:
- Ports are opened only with `serial.serial_for_url` (a tty path, rfc2217://, socket://, spy://,
  loop://), with baud, parity, stop bits, byte size, flow control and the DTR/RTS levels (set
  before the open) from `LinkSettings`, and `exclusive=True` (flock on POSIX ttys; ignored by
  URL handlers that have no lock).
- Reads never block the event loop: a plain POSIX tty is read with `loop.add_reader` on its fd;
  every other port class (URL handlers, spy://, ports without a usable fileno) is read by one
  daemon thread that hands bytes to the loop with `call_soon_threadsafe`.
- Writes never block the loop: they go through a bounded queue to a writer thread. While the port
  is down, writes are dropped and counted (`dropped_bytes`), never buffered without bound.
- A port that fails (USB adapter unplugged: EIO, EOF, SerialException) is closed and reopened
  with exponential backoff (`backoff_s` doubling to `backoff_max_s`), logged and counted
  (`reopens`, `open_failures`); it never raises into the loop. A URL that can never open (bad
  scheme, bad setting) raises `SerialLinkError` from `start()` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import serial
import serial.serialposix

try:
    import termios
except ImportError:  # pragma: no cover - not POSIX
    termios = None  # type: ignore[assignment]  # None: this platform has no termios

from edge_agent.errors import ConfigError

__all__ = ["LinkSettings", "SerialLink", "SerialLinkError", "PARITIES", "unapplied_settings"]

log = logging.getLogger(__name__)

PARITIES = {"none": serial.PARITY_NONE, "even": serial.PARITY_EVEN, "odd": serial.PARITY_ODD,
            "mark": serial.PARITY_MARK, "space": serial.PARITY_SPACE}
_STOPBITS = {1: serial.STOPBITS_ONE, 1.5: serial.STOPBITS_ONE_POINT_FIVE, 2: serial.STOPBITS_TWO}


class SerialLinkError(ConfigError):
    """A serial URL or setting that can never work (exit 78: fix the configuration)."""


@dataclass(frozen=True)
class LinkSettings:
    url: str
    baudrate: int = 115200
    parity: str = "none"  # none | even | odd | mark | space
    stopbits: float = 1
    bytesize: int = 8
    rtscts: bool = False
    dtr: bool = True  # levels set before the open, so a wired board never sees a glitch
    rts: bool = True
    xonxoff: bool = False
    exclusive: bool = True
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0

    def open_port(self) -> Any:
        """Open with serial_for_url. SerialLinkError for settings that can never work;
        serial.SerialException (or OSError) for a port that is absent or busy right now."""
        if self.parity not in PARITIES:
            raise SerialLinkError(f"serial parity {self.parity!r} for {self.url}: unknown. "
                                  f"Hint: use one of {', '.join(PARITIES)}.")
        if self.stopbits not in _STOPBITS:
            raise SerialLinkError(f"serial stopbits {self.stopbits!r} for {self.url}: unknown. "
                                  "Hint: use 1, 1.5 or 2.")
        try:
            port = serial.serial_for_url(
                self.url, do_not_open=True, baudrate=self.baudrate,
                parity=PARITIES[self.parity], stopbits=_STOPBITS[self.stopbits],
                bytesize=self.bytesize, rtscts=self.rtscts, xonxoff=self.xonxoff,
                timeout=0.1, write_timeout=None)
        except ValueError as exc:
            raise SerialLinkError(f"serial port {self.url!r}: pyserial refused the URL or a "
                                  f"setting ({exc}). Hint: a device path like /dev/ttyAMA0 or a "
                                  "URL like socket://HOST:PORT, rfc2217://, spy://, loop://.") \
                from exc
        with contextlib.suppress(AttributeError, ValueError):
            port.exclusive = self.exclusive
        port.dtr = self.dtr
        if not self.rtscts:
            port.rts = self.rts
        try:
            port.open()
        except Exception as exc:
            # the device refused the line settings (tcsetattr: EINVAL), e.g. 1.5 stop bits on
            # a pseudo-terminal: termios.error, which is not an OSError
            if termios is None or not isinstance(exc, termios.error):
                raise
            line = f"{self.bytesize}{PARITIES[self.parity]}{self.stopbits:g}"
            raise SerialLinkError(
                f"serial port {self.url!r} refused the line settings {self.baudrate} baud "
                f"{line} (tcsetattr: {exc.args[-1] if exc.args else exc}). Hint: set "
                "serial.parity, serial.stopbits and serial.baudrate to what the device supports "
                "(a pseudo-terminal or simulator: parity \"none\", stopbits 1).") from exc
        return port


def unapplied_settings(port: Any) -> list[str]:
    """Settings a POSIX tty accepted but did not apply (a pty drops PARENB silently)."""
    if termios is None or type(port) is not serial.serialposix.Serial:
        return []
    cflag = termios.tcgetattr(port.fileno())[2]
    wanted = {"parity": (port.parity != serial.PARITY_NONE, bool(cflag & termios.PARENB)),
              "stopbits=2": (port.stopbits == serial.STOPBITS_TWO, bool(cflag & termios.CSTOPB)),
              "rtscts": (bool(port.rtscts), bool(cflag & termios.CRTSCTS))}
    return [name for name, (want, got) in wanted.items() if want and not got]


class SerialLink:
    """One port: `start()`, `write(bytes)`, `close()`; bytes arrive through `on_data`."""

    def __init__(self, settings: LinkSettings, on_data: Callable[[bytes], None], *,
                 on_state: Callable[[bool], None] = lambda up: None,
                 opener: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self.on_data = on_data
        self.on_state = on_state
        self._opener = opener or settings.open_port
        self.port: Any = None
        self.up = False
        self.counters = {"bytes_in": 0, "bytes_out": 0, "dropped_bytes": 0, "reopens": 0,
                         "open_failures": 0, "link_lost": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._wq: queue.Queue[tuple[Any, bytes] | None] = queue.Queue(maxsize=256)
        self._stop = threading.Event()
        self._reopen_task: asyncio.Task[None] | None = None
        self._generation = 0  # bumps on every open: stale reader threads stay quiet
        self.opened = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self, *, wait: bool = False) -> None:
        """Open now if possible, else keep retrying in the background. `wait`: until open."""
        self._loop = asyncio.get_running_loop()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name=f"serial-w {self.settings.url}")
        self._writer.start()
        if not await self._try_open(first=True):
            self._schedule_reopen()
        if wait:
            await self.opened.wait()

    async def close(self) -> None:
        self._stop.set()
        if self._reopen_task is not None:
            self._reopen_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reopen_task
        self._drop_port()
        with contextlib.suppress(queue.Full):
            self._wq.put_nowait(None)
        if self._writer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._writer.join, 2.0)

    def write(self, data: bytes) -> None:
        """Queue bytes for the port; dropped (and counted) while it is down or the queue is full."""
        if not data:
            return
        if not self.up:
            self.counters["dropped_bytes"] += len(data)
            return
        try:
            self._wq.put_nowait((self.port, data))
        except queue.Full:
            self.counters["dropped_bytes"] += len(data)

    def stats(self) -> dict[str, Any]:
        return {"url": self.settings.url, "up": self.up, **self.counters}

    # -- opening -------------------------------------------------------------------------------
    async def _try_open(self, *, first: bool = False) -> bool:
        assert self._loop is not None
        try:
            port = await self._loop.run_in_executor(None, self._opener)
        except SerialLinkError as exc:
            if first:
                raise
            # a device plugged in again that refuses what the first one took: keep retrying
            self.counters["open_failures"] += 1
            if self.counters["open_failures"] % 20 == 1:
                log.warning(f"serial {self.settings.url}: open failed: {exc}")
            return False
        except (serial.SerialException, OSError) as exc:
            self.counters["open_failures"] += 1
            if first or self.counters["open_failures"] % 20 == 1:
                log.warning(f"serial {self.settings.url}: open failed ({exc}); retrying with "
                            "backoff. Hint: check the cable/adapter and that no other program "
                            "holds the port.")
            return False
        if self._stop.is_set():
            port.close()
            return False
        self._attach(port)
        missing = unapplied_settings(port)
        if missing:
            self.counters["settings_ignored"] = len(missing)
            log.warning(f"serial {self.settings.url}: the device ignored {', '.join(missing)} "
                        "(a pseudo-terminal has no parity or flow control). Hint: test those "
                        "settings over socket:// or real hardware.")
        if not first:
            self.counters["reopens"] += 1
            log.info(f"serial {self.settings.url}: reopened")
        return True

    def _attach(self, port: Any) -> None:
        assert self._loop is not None
        self._generation += 1
        self.port = port
        self.up = True
        if type(port) is serial.serialposix.Serial:
            self._fd = port.fileno()
            self._loop.add_reader(self._fd, self._on_readable, port)
        else:
            self._reader = threading.Thread(target=self._read_loop,
                                            args=(port, self._generation), daemon=True,
                                            name=f"serial-r {self.settings.url}")
            self._reader.start()
        self.opened.set()
        self.on_state(True)

    def _drop_port(self) -> None:
        port, self.port = self.port, None
        was_up, self.up = self.up, False
        self.opened = asyncio.Event()
        if self._fd is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        if port is not None:
            with contextlib.suppress(Exception):
                port.cancel_read()
            with contextlib.suppress(Exception):
                port.close()
        if was_up:
            self.on_state(False)

    def _lost(self, port: Any, why: str) -> None:
        if port is not self.port or self._stop.is_set():
            return
        self.counters["link_lost"] += 1
        log.warning(f"serial {self.settings.url}: link lost ({why}); reopening with backoff")
        self._drop_port()
        self._schedule_reopen()

    def _schedule_reopen(self) -> None:
        if self._stop.is_set() or (self._reopen_task and not self._reopen_task.done()):
            return
        assert self._loop is not None
        self._reopen_task = self._loop.create_task(self._reopen_loop())

    async def _reopen_loop(self) -> None:
        delay = self.settings.backoff_s
        while not self._stop.is_set():
            await asyncio.sleep(delay)
            if await self._try_open():
                return
            delay = min(delay * 2, self.settings.backoff_max_s)

    # -- reading -------------------------------------------------------------------------------
    def _on_readable(self, port: Any) -> None:
        try:
            data = os.read(port.fileno(), 4096)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(port, f"read: {exc.strerror or exc}")
            return
        if not data:
            self._lost(port, "end of file (hang-up)")
            return
        self._deliver(port, data)

    def _deliver(self, port: Any, data: bytes) -> None:
        if port is not self.port:
            return
        self.counters["bytes_in"] += len(data)
        self.on_data(data)

    def _read_loop(self, port: Any, generation: int) -> None:
        assert self._loop is not None
        loop = self._loop
        while not self._stop.is_set() and generation == self._generation:
            try:
                data = port.read(max(1, min(4096, port.in_waiting)))
            except Exception as exc:  # noqa: BLE001 - any failure means the link is gone
                if generation == self._generation and not self._stop.is_set():
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._lost, port, f"read: {exc}")
                return
            if data:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._deliver, port, data)

    # -- writing -------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._wq.get()
            if item is None:
                return
            port, data = item
            try:
                port.write(data)
                self.counters["bytes_out"] += len(data)
            except Exception as exc:  # noqa: BLE001 - reported to the loop, which reopens
                self.counters["dropped_bytes"] += len(data)
                if self._loop is not None and not self._stop.is_set():
                    with contextlib.suppress(RuntimeError):
                        self._loop.call_soon_threadsafe(self._lost, port, f"write: {exc}")
