"""Boot the systemd guest (amd64 under TCG, q35) and run one shell command once systemd is up.

    with SystemdGuest("systemctl is-system-running --wait") as g:
        r = g.wait(timeout=120)
    assert r.output.strip() == "running"

The command runs as root from ea-run.service, after multi-user.target, with the payload disk
mounted at /ea: /ea/cmd (the command), the `files` given (relative to /ea), and /ea/src (the
project's source; /opt/edge-agent points there). The command's output goes to ttyS1 (out.log),
the console (kernel, systemd) to ttyS0 (console.log). Files the command leaves in /ea can be read
back after the boot with `read_payload()` until the guest is closed. With null_modem=True the
guest has two more 16550s wired to each other (a null-modem cable: a Unix socket in the work
folder, QEMU both ends): ttyS2 (0x3e8, IRQ 5) for the daemon's `serial.port` and ttyS3 (0x2e8,
IRQ 7) for the command to type into; own IRQs, since two ISA UARTs on one line lose interrupts.

Invariants: as for every QemuGuest (QEMU killed on close, timeouts everywhere); the cached root
image is attached with snapshot=on, so no boot changes it; `-cpu max` (x86_64 TCG: numpy wheels
need SSE4.2, which the default qemu64 model lacks).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .build_systemd_guest import SystemdImage, systemd_image
from .disks import make_ext4, read_file, require_tool
from .guest import GuestResult, QemuGuest, copy_source, drive_args

__all__ = ["SystemdGuest", "run_systemd"]


class SystemdGuest(QemuGuest):
    """One boot of the systemd guest. `disks` come after the root (vda) and payload (vdb)
    disks: /dev/vdc, /dev/vdd, ..."""

    def __init__(self, command: str, *, image: SystemdImage | None = None,
                 files: Mapping[str, bytes] | None = None, null_modem: bool = False,
                 **kwargs: object) -> None:
        super().__init__(command, files=files, **kwargs)  # type: ignore[arg-type]  # Guest's keywords, checked there
        self.image = image
        self.null_modem = null_modem
        self.payload: Path | None = None

    def __enter__(self) -> SystemdGuest:
        super().__enter__()
        return self

    def _payload(self) -> Path:
        assert self.workdir is not None
        content = self.workdir / "payload"
        content.mkdir()
        (content / "cmd").write_text(self.command)
        for name, data in self.files.items():
            path = content / name.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o755 if data.startswith(b"#!") else 0o644)
        if self.with_source:
            copy_source(content / "src", "/ea/src")
        size = sum(p.stat().st_size for p in content.rglob("*") if p.is_file())
        return make_ext4(self.workdir / "payload.img", 64 + 2 * size // (1 << 20), content,
                         label="ea-payload")

    def _prepare(self) -> list[str]:
        assert self.workdir is not None
        image = self.image or systemd_image()
        self.payload = self._payload()
        wd = self.workdir
        append = ["console=ttyS0", "root=/dev/vda", "rw", "quiet", "panic=-1",
                  "systemd.show_status=0", "systemd.unified_cgroup_hierarchy=1",
                  *self.kernel_args]
        return [
            require_tool("qemu-system-x86_64", "qemu-system-x86"),
            "-M", "q35", "-cpu", "max", "-smp", "1", "-m", str(self.memory_mb),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(image.kernel), "-initrd", str(image.initrd),
            "-append", " ".join(append),
            "-chardev", f"file,id=con,path={wd / 'console.log'}", "-serial", "chardev:con",
            "-chardev", f"file,id=eaout,path={wd / 'out.log'}", "-serial", "chardev:eaout",
            "-drive", f"if=none,id=root,format=raw,snapshot=on,file={image.rootfs}",
            "-device", "virtio-blk-pci,drive=root",
            *drive_args([self.payload], first=1),
            *drive_args(self.disks, first=2),
            *(self._null_modem_args() if self.null_modem else []),
            *self.qemu_args,
        ]

    def _null_modem_args(self) -> list[str]:
        """ttyS2 <-> ttyS3: the first chardev listens on the socket (no wait), the second,
        created after it, connects to it."""
        assert self.workdir is not None
        sock = self.workdir / "uart.sock"
        return ["-chardev", f"socket,id=uart,path={sock},server=on,wait=off",
                "-device", "isa-serial,chardev=uart,index=2,iobase=0x3e8,irq=5",
                "-chardev", f"socket,id=uartpeer,path={sock},server=off",
                "-device", "isa-serial,chardev=uartpeer,index=3,iobase=0x2e8,irq=7"]

    def read_payload(self, path: str) -> bytes | None:
        """A file the command left on the payload disk (path relative to /ea)."""
        assert self.payload is not None, "start() first"
        return read_file(self.payload, "/" + path.lstrip("/"))


def run_systemd(command: str, *, timeout: float = 180.0, **kwargs: object) -> GuestResult:
    """Boot, run `command` once systemd is up, power off; the GuestResult."""
    with SystemdGuest(command, **kwargs) as guest:  # type: ignore[arg-type]  # SystemdGuest's keywords, checked there
        return guest.wait(timeout)
