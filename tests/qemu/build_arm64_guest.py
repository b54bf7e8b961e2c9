"""Build the arm64 test guest: Debian's arm64 kernel Image and an initramfs holding busybox,
python3.11 with sqlite3, numpy and the project's pure-Python dependencies (aarch64 wheels), and
the kernel modules for virtio disks and consoles. Run as a script to build (or find) it:

    .venv/bin/python tests/qemu/build_arm64_guest.py      # prints the cache folder

Invariants: the result lives in tests/.cache/qemu/arm64-<hash>/ where <hash> covers this file,
the modules it uses, init.sh and the package lists below, so editing any of them rebuilds;
the project's own source is NOT in the image: guest.py appends it at boot as a second cpio
archive, so editing edge_agent/ never forces a rebuild. Python files are precompiled on the
host (same 3.11 bytecode) because compiling them under emulation costs seconds per boot.
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

from qemu import cache, cpio, debs, kmods  # noqa: E402
from qemu.errors import HarnessError  # noqa: E402

__all__ = ["DEBS", "MODULES", "SKIP_WHEELS", "WHEELS", "GuestImage", "arm64_image", "main"]

ARCH = "arm64"
PLATFORM = "manylinux2014_aarch64"  # numpy 2.2.6 is the last with such a wheel; fine for 3.11
DEBS = ["busybox-static", "python3.11-minimal", "libpython3.11-stdlib", "libsqlite3-0",
        "libstdc++6"]  # libstdc++6: the tokenizers extension links it
# What `import edge_agent, firmware_tools` needs (pyproject's dependencies) on Python 3.11, and
# what llama-cpp-python's Python side imports (typing-extensions, diskcache; numpy and jinja2
# are already here), so llama_aarch64's overlay needs nothing but itself.
WHEELS = ["numpy", "pyserial", "h11", "sqlite-utils", "tokenizers", "pyelftools", "jinja2",
          "threadpoolctl", "typing-extensions", "diskcache"]
# Pulled in by tokenizers (huggingface_hub, for from_pretrained) and sqlite-utils (pip, for its
# `install` command) but never imported by the project: ~30 MB of initramfs saved.
SKIP_WHEELS = ["huggingface_hub", "requests", "urllib3", "idna", "certifi", "charset_normalizer",
               "fsspec", "filelock", "tqdm", "pyyaml", "pip"]
MODULES = ["virtio_pci", "virtio_blk", "virtio_console", "crc32c_generic", "ext4"]
PRUNE = [
    "usr/share/doc", "usr/share/man", "usr/share/locale", "usr/share/info", "usr/share/lintian",
    "usr/lib/python3.11/test", "usr/lib/python3.11/idlelib", "usr/lib/python3.11/tkinter",
    "usr/lib/python3.11/turtledemo", "usr/lib/python3.11/lib2to3", "usr/lib/python3.11/ensurepip",
    "usr/lib/python3.11/pydoc_data", "usr/lib/aarch64-linux-gnu/gconv", "boot", "var/lib/dpkg",
    "var/cache",
]
SITE = "usr/local/lib/python3.11/dist-packages"


@dataclass(frozen=True)
class GuestImage:
    """A built guest: kernel, initramfs, and what went into them (manifest.json)."""

    folder: Path
    kernel: Path
    initrd: Path
    manifest: dict[str, object]


def _inputs_key() -> str:
    here = cache.HERE
    files = [Path(__file__).resolve(), here / "debs.py", here / "cpio.py", here / "kmods.py",
             here / "init.sh"]
    return cache.inputs_hash(files, [ARCH, PLATFORM, *DEBS, *WHEELS, *SKIP_WHEELS, *MODULES,
                                              *PRUNE])


def _compile(root: Path, subdir: str) -> None:
    target = root / subdir
    if not target.is_dir():
        return
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", "-s", str(root), "-p", "/",
         "--invalidation-mode", "unchecked-hash", str(target)],
        check=False, capture_output=True, timeout=600,
    )


def _prune_tests(site: Path) -> None:
    for tests in list(site.glob("*/**/tests")):
        if tests.is_dir():
            shutil.rmtree(tests, ignore_errors=True)


def _build(dest: Path) -> None:
    apt = debs.AptRoot(ARCH)
    kernel_pkg = apt.kernel_package()
    kernel_deb = apt.download(kernel_pkg)
    user_debs = apt.fetch_closure(DEBS)
    with tempfile.TemporaryDirectory(prefix="ea-arm64-", dir=dest) as tmp:
        work = Path(tmp)
        kroot, root = work / "kernel", work / "root"
        debs.extract_debs([kernel_deb], kroot)
        vmlinuz = sorted((kroot / "boot").glob("vmlinuz-*"))
        if not vmlinuz:
            raise HarnessError(f"{kernel_deb.name}: no boot/vmlinuz-*. Hint: delete "
                               "tests/.cache/qemu/apt-arm64 and rebuild.")
        shutil.copy2(vmlinuz[0], dest / "Image")
        debs.extract_debs(user_debs, root)
        load_order = kmods.copy_modules(kroot, root, MODULES)
        (root / "etc").mkdir(exist_ok=True)
        (root / "etc" / "ea-modules").write_text("".join(f"{m}\n" for m in load_order))
        py = root / "usr" / "bin" / "python3"
        if not py.exists():
            py.symlink_to("python3.11")
        skip = {name.replace("_", "-") for name in SKIP_WHEELS}
        wanted = [w for w in debs.download_wheels(WHEELS, PLATFORM, work / "wheels")
                  if w.name.split("-")[0].lower().replace("_", "-") not in skip]
        debs.install_wheels(wanted, PLATFORM, root / SITE)
        (root / SITE / "edge-agent.pth").write_text("/opt/edge-agent\n")
        for rel in PRUNE:
            shutil.rmtree(root / rel, ignore_errors=True)
        _prune_tests(root / SITE)
        _compile(root, "usr/lib/python3.11")
        _compile(root, SITE)
        init = root / "init"
        shutil.copy2(cache.HERE / "init.sh", init)
        init.chmod(0o755)
        cpio.write_tree(root, dest / "initramfs.cpio")
        manifest = {
            "arch": ARCH,
            "kernel_package": kernel_deb.name,
            "debs": [d.name for d in user_debs],
            "wheels": [w.name for w in wanted],
            "modules": load_order,
            "initramfs_bytes": (dest / "initramfs.cpio").stat().st_size,
        }
        (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def arm64_image() -> GuestImage:
    """The cached arm64 guest, built first if needed (PackagesUnavailable when offline)."""
    folder = cache.cached_build("arm64", _inputs_key(), _build)
    manifest = json.loads((folder / "manifest.json").read_text())
    return GuestImage(folder, folder / "Image", folder / "initramfs.cpio", manifest)


def main(argv: list[str] | None = None) -> int:
    img = arm64_image()
    print(img.folder)
    print(f"kernel {img.manifest['kernel_package']}, initramfs "
          f"{os.path.getsize(img.initrd) / 1e6:.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
