"""Boot the arm64 test guest under QEMU (TCG), run one shell command in it, collect its output.

    with Arm64Guest("python3 -c 'import numpy; print(numpy.__version__)'") as g:
        result = g.wait(timeout=60)
    assert result.rc == 0 and "2." in result.output

Invariants: QEMU is always killed when the guest object is closed (context exit, error or
timeout), so no test leaves an emulator running; every wait has a timeout and raises
GuestTimeout with the console's tail; the command's output travels on its own virtio port
(`ea.out`), never mixed with kernel messages on the console; the project's source tree is
appended to the cached initramfs at boot (/opt/edge-agent, precompiled), so the image is not
rebuilt when the code changes. `-cpu cortex-a72` by default (cortex-a76 for the aarch64
llama.cpp build, which uses its dotprod/fp16 instructions), not `max` (pointer authentication
emulation makes `max` 6-8x slower). With uart=True the guest's PL011 (ttyAMA0) is a host pty
(`guest.uart_path`, open it with pyserial) and the console moves to hvc0.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .build_arm64_guest import GuestImage, arm64_image
from .cache import REPO
from .cpio import CpioWriter
from .disks import require_tool
from .errors import GuestError, GuestTimeout

__all__ = ["SOURCE_ITEMS", "Arm64Guest", "GuestResult", "QemuGuest", "copy_source",
           "drive_args", "run_arm64"]

SOURCE_ITEMS = ("edge_agent", "firmware_tools", "board_profiles", "cgroups", "systemd",
                "pyproject.toml")
_T = TypeVar("_T")
_EXIT = re.compile(r"EA-EXIT (\d+)")
_BEGIN = re.compile(r"EA-BEGIN uptime=([\d.]+)")
_MAX_CMDLINE_CMD = 1200  # arm64 COMMAND_LINE_SIZE is 2048; longer commands go in a file


@dataclass(frozen=True)
class GuestResult:
    rc: int | None          # the command's exit status (None: the guest never reported one)
    output: str             # what the command wrote (stdout and stderr)
    console: str            # the serial console (kernel messages, init's markers)
    boot_seconds: float | None  # guest uptime when the command started
    wall_seconds: float     # host time from QEMU start to QEMU exit


def _tail(text: str, n: int = 2500) -> str:
    return text[-n:] if len(text) > n else text


def copy_source(dest: Path, prefix: str) -> None:
    """Copy the project's source (SOURCE_ITEMS) to dest, precompiled as if it lived at
    `prefix` in the guest (3.11 bytecode, unchecked hashes: the copy is never edited)."""
    for item in SOURCE_ITEMS:
        p = REPO / item
        if p.is_dir():
            shutil.copytree(p, dest / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif p.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest / item)
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-s", str(dest), "-p", prefix,
         "--invalidation-mode", "unchecked-hash", str(dest)],
        capture_output=True, timeout=300, check=False)


def drive_args(disks: Sequence[Path | str], first: int = 0) -> list[str]:
    """QEMU arguments attaching raw disks (paths, or `file=` values such as an NBD URI) as
    virtio-blk devices, in order (/dev/vda, /dev/vdb, ...)."""
    args = []
    for i, disk in enumerate(disks, start=first):
        file = str(disk) if isinstance(disk, str) else str(Path(disk).resolve())
        args += ["-drive", f"if=none,id=d{i},format=raw,file={file}",
                 "-device", f"virtio-blk-pci,drive=d{i}"]
    return args


class QemuGuest:
    """What every guest shares: a private work folder, QEMU started in its own session with the
    console in console.log and the command's output in out.log, waits with timeouts, and a kill
    that is always done. Subclasses build the QEMU command line in `_prepare`."""

    def __init__(self, command: str, *, disks: Sequence[Path | str] = (), memory_mb: int = 1024,
                 with_source: bool = True, files: Mapping[str, bytes] | None = None,
                 kernel_args: Sequence[str] = (), qemu_args: Sequence[str] = ()) -> None:
        self.command = command
        self.disks = list(disks)
        self.memory_mb = memory_mb
        self.with_source = with_source
        self.files = dict(files or {})
        self.kernel_args = list(kernel_args)
        self.qemu_args = list(qemu_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir: Path | None = None
        self._t0 = 0.0
        self._wall: float | None = None

    def _prepare(self) -> list[str]:
        raise NotImplementedError

    def _started(self) -> None:
        """Hook run right after QEMU was spawned."""

    # -- files the guest writes to ------------------------------------------------------------
    def _read(self, name: str) -> str:
        if self.workdir is None:
            return ""
        path = self.workdir / name
        return path.read_bytes().decode("utf-8", "replace") if path.exists() else ""

    @property
    def console(self) -> str:
        return self._read("console.log")

    @property
    def output(self) -> str:
        return _EXIT.sub("", self._read("out.log")).rstrip("\n") + (
            "\n" if self._read("out.log").strip() else "")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> QemuGuest:
        self.workdir = Path(tempfile.mkdtemp(prefix="ea-qemu-"))
        cmd = self._prepare()
        (self.workdir / "qemu-command").write_text(" ".join(cmd) + "\n")
        self._t0 = time.monotonic()
        with open(self.workdir / "qemu.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        self._started()
        return self

    def _poll(self, probe: Callable[[], _T | None], timeout: float, what: str) -> _T:
        deadline = time.monotonic() + timeout
        while True:
            hit = probe()
            if hit:
                return hit
            assert self.proc is not None
            if self.proc.poll() is not None:
                hit = probe()
                if hit:
                    return hit
                raise GuestError(f"waiting for {what}: QEMU exited {self.proc.returncode}. "
                                 f"QEMU said: {_tail(self._read('qemu.log'), 800)!r}; console "
                                 f"tail: {_tail(self.console)!r}. Hint: see {self.workdir}.")
            if time.monotonic() > deadline:
                self.kill()
                raise GuestTimeout(f"waiting for {what}: nothing after {timeout:.0f} s; QEMU "
                                   f"killed. Console tail: {_tail(self.console)!r}; output "
                                   f"tail: {_tail(self.output, 800)!r}. Hint: raise the "
                                   "timeout if the machine is loaded, or read the console.")
            time.sleep(0.05)

    def wait_output(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Block until the command's output matches `pattern` (a regex)."""
        rx = re.compile(pattern)
        return self._poll(lambda: rx.search(self._read("out.log")), timeout,
                          f"output matching {pattern!r}")

    def wait(self, timeout: float = 120.0) -> GuestResult:
        """Wait for the guest to power off; the result of the command."""
        assert self.proc is not None, "start() first"
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise GuestTimeout(
                f"guest command {self.command[:80]!r} did not finish in {timeout:.0f} s; QEMU "
                f"killed. Console tail: {_tail(self.console)!r}; output tail: "
                f"{_tail(self.output, 800)!r}. Hint: raise the timeout if the host is loaded."
            ) from None
        self._wall = time.monotonic() - self._t0
        return self.result()

    def result(self) -> GuestResult:
        console = self.console
        m = _EXIT.search(console)
        b = _BEGIN.search(console)
        return GuestResult(rc=int(m.group(1)) if m else None, output=self.output,
                           console=console, boot_seconds=float(b.group(1)) if b else None,
                           wall_seconds=self._wall or time.monotonic() - self._t0)

    def kill(self) -> None:
        """Power cut: SIGKILL QEMU (no flush of anything it holds) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            self._wall = time.monotonic() - self._t0

    def close(self) -> None:
        self.kill()
        if self.workdir is not None and not os.environ.get("EDGE_AGENT_QEMU_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> QemuGuest:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


class Arm64Guest(QemuGuest):
    """One boot of the arm64 guest. Disks are raw image paths or `file=` strings for QEMU
    (e.g. an NBD URI); the first one is /dev/vda, mounted at /mnt/disk unless mount='none'.
    `files` maps guest paths to bytes added to the initramfs; `extra_initrds` are cpio archives
    appended after the image's (e.g. llama_aarch64's llama.cpio), before the source and files."""

    def __init__(self, command: str, *, uart: bool = False, mount: str = "rw",
                 image: GuestImage | None = None, cpu: str = "cortex-a72",
                 extra_initrds: Sequence[Path] = (), **kwargs: object) -> None:
        super().__init__(command, **kwargs)  # type: ignore[arg-type]  # Guest's keywords, checked there
        self.uart = uart
        self.mount = mount
        self.image = image
        self.cpu = cpu
        self.extra_initrds = list(extra_initrds)
        self.uart_path: str | None = None

    def __enter__(self) -> Arm64Guest:
        super().__enter__()
        return self

    def _initrd(self, base: Path) -> Path:
        assert self.workdir is not None
        overlay = self.workdir / "overlay.cpio"
        with open(overlay, "wb") as out:
            w = CpioWriter(out)
            if self.with_source:
                src = self.workdir / "src"
                copy_source(src, "/opt/edge-agent")
                w.tree(src, "opt/edge-agent")
            if len(self.command) > _MAX_CMDLINE_CMD:
                w.file("ea/cmd", self.command.encode())
            for name, data in self.files.items():
                w.file(name.lstrip("/"), data, 0o755 if data.startswith(b"#!") else 0o644)
            w.close()
        initrd = self.workdir / "initrd.cpio"
        with open(initrd, "wb") as out:
            for part in (base, *self.extra_initrds, overlay):
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        overlay.unlink()
        return initrd

    def qemu_command(self, image: GuestImage, initrd: Path) -> list[str]:
        assert self.workdir is not None
        wd = self.workdir
        append = ["quiet", "panic=-1", "ea.out=1", f"ea.mount={self.mount}"]
        append.append("console=hvc0" if self.uart else "console=ttyAMA0")
        if len(self.command) <= _MAX_CMDLINE_CMD:
            append.append("ea.cmd=" + base64.b64encode(self.command.encode()).decode())
        append += self.kernel_args
        cmd = [
            require_tool("qemu-system-aarch64", "qemu-system-arm"),
            "-M", "virt", "-cpu", self.cpu, "-smp", "1", "-m", str(self.memory_mb),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(image.kernel), "-initrd", str(initrd), "-append", " ".join(append),
            "-device", "virtio-serial-pci,id=vser0",
            "-chardev", f"file,id=eaout,path={wd / 'out.log'}",
            "-device", "virtserialport,bus=vser0.0,chardev=eaout,name=ea.out",
            "-chardev", f"file,id=con,path={wd / 'console.log'}",
        ]
        if self.uart:
            cmd += ["-device", "virtconsole,bus=vser0.0,chardev=con",
                    "-chardev", "pty,id=uart0", "-serial", "chardev:uart0"]
        else:
            cmd += ["-serial", "chardev:con"]
        return cmd + drive_args(self.disks) + self.qemu_args

    def _prepare(self) -> list[str]:
        image = self.image or arm64_image()
        return self.qemu_command(image, self._initrd(image.initrd))

    def _started(self) -> None:
        if self.uart:
            m = self._poll(lambda: re.search(r"(/dev/pts/\d+) \(label uart0\)",
                                             self._read("qemu.log")), 10.0, "the uart pty")
            self.uart_path = m.group(1)


def run_arm64(command: str, *, timeout: float = 120.0, **kwargs: object) -> GuestResult:
    """Boot, run `command`, power off; the result (raises GuestTimeout after `timeout`)."""
    with Arm64Guest(command, **kwargs) as guest:  # type: ignore[arg-type]  # Arm64Guest's keywords, checked there
        return guest.wait(timeout)
