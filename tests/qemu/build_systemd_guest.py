"""Build the systemd test guest (amd64, booted under TCG): a Debian bookworm root file system
made by mmdebstrap with systemd as PID 1 and python3, the project's dependencies as x86_64
wheels, packed as a raw ext4 image; Debian's amd64 kernel; a tiny busybox initramfs that loads
the virtio and ext4 modules and switches to /dev/vda. Run as a script to build (or find) it:

    .venv/bin/python tests/qemu/build_systemd_guest.py     # prints the cache folder

Invariants: cached in tests/.cache/qemu/systemd-<hash>/ keyed by this file, the modules it
uses and the package lists; root.img is never written by a boot (SystemdGuest attaches it
with snapshot=on); the harness unit ea-run.service (Type=simple, so `systemctl
is-system-running --wait` inside it does not wait for itself) mounts the per-boot payload disk
/dev/vdb at /ea, runs /ea/cmd with output on ttyS1, prints EA-EXIT on the console and powers
off. /opt/edge-agent points at the project's source on the payload disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `qemu` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "qemu"  # noqa: A001

from qemu import cache, cpio, debs, disks, kmods  # noqa: E402
from qemu.build_arm64_guest import SKIP_WHEELS, WHEELS  # noqa: E402
from qemu.errors import HarnessError, PackagesUnavailable  # noqa: E402

__all__ = ["ROOTFS_PACKAGES", "SystemdImage", "main", "systemd_image"]

ARCH = "amd64"
PLATFORM = "manylinux2014_x86_64"
ROOTFS_PACKAGES = ["systemd", "systemd-sysv", "udev", "python3", "kmod"]
MODULES = ["virtio_pci", "virtio_blk", "crc32c_generic", "ext4"]
ROOT_MB = 1536
SITE = "usr/local/lib/python3.11/dist-packages"

INIT = """#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /newroot
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r m; do insmod "$m" 2>/dev/null; done < /etc/ea-modules
i=0; while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
mount -t ext4 -o rw /dev/vda /newroot || { echo "ea-initrd: cannot mount /dev/vda"; exec sh; }
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /sbin/init
"""

RUN_SCRIPT = """#!/bin/sh
# Started by ea-run.service: run the test harness's command from the payload disk.
exec >/dev/ttyS1 2>&1
i=0; while [ ! -b /dev/vdb ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
mkdir -p /ea && mount /dev/vdb /ea
echo "EA-BEGIN uptime=$(cut -d' ' -f1 /proc/uptime)" > /dev/console
cd /root
sh /ea/cmd < /dev/null
rc=$?
echo "$rc" > /ea/rc
echo "EA-EXIT $rc"
echo "EA-EXIT $rc uptime=$(cut -d' ' -f1 /proc/uptime)" > /dev/console
sync
umount /ea
systemctl --force poweroff
"""

RUN_UNIT = """[Unit]
Description=edge-agent test harness command (tests/qemu)
After=multi-user.target

[Service]
Type=simple
ExecStart=/usr/local/sbin/ea-run

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class SystemdImage:
    folder: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    manifest: dict[str, object]


def _inputs_key() -> str:
    here = cache.HERE
    files = [Path(__file__).resolve(), here / "debs.py", here / "cpio.py", here / "kmods.py",
             here / "disks.py"]
    return cache.inputs_hash(files, [ARCH, PLATFORM, *ROOTFS_PACKAGES, *MODULES, *WHEELS,
                                     *SKIP_WHEELS, str(ROOT_MB)])


def _mmdebstrap(rootfs: Path) -> None:
    tool = disks.require_tool("mmdebstrap", "mmdebstrap")
    mirrors = [f"deb {url} {suite} main" for url, suite in debs.SUITES]
    cmd = [tool, "--variant=minbase", "--mode=root", f"--architectures={ARCH}",
           "--include=" + ",".join(ROOTFS_PACKAGES), "--skip=output/dev",
           '--aptopt=APT::Install-Recommends "false"', "--format=directory",
           "bookworm", str(rootfs), *mirrors]
    cache.log(f"mmdebstrap ({ARCH}, {', '.join(ROOTFS_PACKAGES)}): ~40-70 s")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        raise PackagesUnavailable("mmdebstrap took more than 900 s. Hint: check that "
                                  "deb.debian.org is reachable and fast.") from exc
    if p.returncode != 0:
        tail = p.stderr.strip()[-1500:]
        net = any(s in tail for s in ("Failed to fetch", "Could not resolve", "Temporary "
                                      "failure", "Unable to connect", "apt-get update failed"))
        raise (PackagesUnavailable if net else HarnessError)(
            f"mmdebstrap bookworm ({ARCH}) exited {p.returncode}: {tail}. Hint: "
            + ("check that deb.debian.org is reachable." if net else
               "it needs root (mode=root) and a working /proc; see tests/qemu/README.md."))


def _customize(rootfs: Path, work: Path) -> list[str]:
    (rootfs / "etc" / "hostname").write_text("ea-guest\n")
    (rootfs / "etc" / "fstab").write_text("# root is mounted by the harness initramfs\n")
    run = rootfs / "usr" / "local" / "sbin" / "ea-run"
    run.parent.mkdir(parents=True, exist_ok=True)
    run.write_text(RUN_SCRIPT)
    run.chmod(0o755)
    system = rootfs / "etc" / "systemd" / "system"
    (system / "ea-run.service").write_text(RUN_UNIT)
    wants = system / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "ea-run.service").symlink_to("/etc/systemd/system/ea-run.service")
    # No logins on consoles (the harness drives the guest), no timers waking up during tests.
    for unit in ("getty.target", "getty-static.service", "getty@.service",
                 "serial-getty@.service", "apt-daily.timer",
                 "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer",
                 "dpkg-db-backup.timer", "e2scrub_reap.service"):
        (system / unit).unlink(missing_ok=True)
        (system / unit).symlink_to("/dev/null")
    (rootfs / "opt").mkdir(exist_ok=True)
    (rootfs / "opt" / "edge-agent").symlink_to("/ea/src")
    skip = {name.replace("_", "-") for name in SKIP_WHEELS}
    wheels = [w for w in debs.download_wheels(WHEELS, PLATFORM, work / "wheels")
              if w.name.split("-")[0].lower().replace("_", "-") not in skip]
    debs.install_wheels(wheels, PLATFORM, rootfs / SITE)
    (rootfs / SITE / "edge-agent.pth").write_text("/opt/edge-agent\n")
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "-s", str(rootfs),
                    "-p", "/", "--invalidation-mode", "unchecked-hash", str(rootfs / SITE)],
                   capture_output=True, timeout=600, check=False)
    for rel in ("usr/share/doc", "usr/share/man", "usr/share/locale", "var/cache/apt",
                "var/lib/apt/lists"):
        shutil.rmtree(rootfs / rel, ignore_errors=True)
    return [w.name for w in wheels]


def _build(dest: Path) -> None:
    apt = debs.AptRoot(ARCH)
    kernel_deb = apt.download(apt.kernel_package())
    busybox = apt.download("busybox-static")
    with tempfile.TemporaryDirectory(prefix="ea-systemd-", dir=dest) as tmp:
        work = Path(tmp)
        kroot, initrd_root, rootfs = work / "kernel", work / "initrd", work / "rootfs"
        debs.extract_debs([kernel_deb], kroot)
        vmlinuz = sorted((kroot / "boot").glob("vmlinuz-*"))
        if not vmlinuz:
            raise HarnessError(f"{kernel_deb.name}: no boot/vmlinuz-*. Hint: delete "
                               "tests/.cache/qemu/apt-amd64 and rebuild.")
        shutil.copy2(vmlinuz[0], dest / "vmlinuz")
        debs.extract_debs([busybox], initrd_root)
        order = kmods.copy_modules(kroot, initrd_root, MODULES)
        (initrd_root / "etc").mkdir(exist_ok=True)
        (initrd_root / "etc" / "ea-modules").write_text("".join(f"{m}\n" for m in order))
        (initrd_root / "init").write_text(INIT)
        (initrd_root / "init").chmod(0o755)
        shutil.rmtree(initrd_root / "usr" / "share", ignore_errors=True)
        cpio.write_tree(initrd_root, dest / "initrd.cpio")
        _mmdebstrap(rootfs)
        wheels = _customize(rootfs, work)
        disks.make_ext4(dest / "root.img", ROOT_MB, rootfs, label="ea-root")
        manifest = {"arch": ARCH, "kernel_package": kernel_deb.name, "modules": order,
                    "rootfs_packages": ROOTFS_PACKAGES, "wheels": wheels}
        (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def systemd_image() -> SystemdImage:
    """The cached systemd guest, built first if needed (PackagesUnavailable when offline)."""
    folder = cache.cached_build("systemd", _inputs_key(), _build)
    manifest = json.loads((folder / "manifest.json").read_text())
    return SystemdImage(folder, folder / "vmlinuz", folder / "initrd.cpio",
                        folder / "root.img", manifest)


def main(argv: list[str] | None = None) -> int:
    img = systemd_image()
    print(img.folder)
    print(f"kernel {img.manifest['kernel_package']}, root.img "
          f"{os.path.getsize(img.rootfs) / 1e6:.0f} MB (sparse)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
