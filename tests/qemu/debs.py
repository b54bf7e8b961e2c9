"""Debian packages and wheels for a foreign (or native) architecture, without touching the host.

Invariants: apt runs with a private configuration (APT_CONFIG) whose state, cache and sources
live under cache_root()/apt-<arch>/, with an empty dpkg status, so the host's dpkg database and
apt lists are never read or written; packages are only unpacked (`dpkg-deb -x`), never installed;
every network failure is reported as PackagesUnavailable (the only error a test may skip on).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .cache import cache_root, log
from .errors import HarnessError, PackagesUnavailable

__all__ = ["AptRoot", "download_wheels", "extract_debs", "install_wheels"]

SUITES = (
    ("http://deb.debian.org/debian", "bookworm"),
    ("http://deb.debian.org/debian", "bookworm-updates"),
    ("http://deb.debian.org/debian-security", "bookworm-security"),
)
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
_NET_HINT = (
    "Hint: check that deb.debian.org (or the configured mirror) and the package index are "
    "reachable; the QEMU tests skip when packages cannot be fetched."
)


class AptRoot:
    """A private apt for one architecture (`arm64`, `amd64`), kept between builds."""

    def __init__(self, arch: str, root: Path | None = None) -> None:
        self.arch = arch
        self.root = root or cache_root() / f"apt-{arch}"
        self.conf = self.root / "apt.conf"
        self.archives = self.root / "cache" / "archives"
        self._updated = False

    def _setup(self) -> None:
        for sub in ("etc/apt/apt.conf.d", "etc/apt/preferences.d", "etc/apt/sources.list.d",
                    "state/lists/partial", "cache/archives/partial"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        status = self.root / "state" / "status"
        if not status.exists():
            status.write_text("")
        sources = "".join(f"deb [signed-by={KEYRING}] {url} {suite} main\n"
                          for url, suite in SUITES)
        (self.root / "etc" / "apt" / "sources.list").write_text(sources)
        r = self.root
        self.conf.write_text(
            f'APT::Architecture "{self.arch}";\n'
            f'APT::Architectures {{ "{self.arch}"; }};\n'
            f'Dir::Etc "{r}/etc/apt";\n'
            f'Dir::State "{r}/state";\n'
            f'Dir::State::status "{r}/state/status";\n'
            f'Dir::Cache "{r}/cache";\n'
            'APT::Install-Recommends "false";\n'
            'APT::Sandbox::User "root";\n'
            'Acquire::Languages "none";\n'
            'Acquire::Retries "2";\n'
            'Acquire::http::Timeout "30";\n'
        )

    def apt(self, *args: str, cwd: Path | None = None, timeout: float = 300) -> str:
        env = dict(os.environ, APT_CONFIG=str(self.conf), DEBIAN_FRONTEND="noninteractive",
                   LC_ALL="C")
        cmd = [args[0], *args[1:]]
        try:
            p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                               timeout=timeout)
        except FileNotFoundError as exc:
            raise HarnessError(f"{cmd[0]}: not installed. Hint: the QEMU harness needs apt "
                               "(a Debian host).") from exc
        except subprocess.TimeoutExpired as exc:
            raise PackagesUnavailable(f"`{' '.join(cmd)}` ({self.arch}) took more than "
                                      f"{timeout:.0f} s. {_NET_HINT}") from exc
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip()[-1500:]
            exc_type = (PackagesUnavailable
                        if re.search(r"(Failed to fetch|Could not resolve|Temporary failure|"
                                     r"Unable to connect|Connection failed|timed out)", tail)
                        else HarnessError)
            raise exc_type(f"`{' '.join(cmd)}` ({self.arch}) exited {p.returncode}: {tail}. "
                           + (_NET_HINT if exc_type is PackagesUnavailable else
                              "Hint: a package name may be wrong for this Debian release."))
        return p.stdout

    def update(self) -> None:
        if self._updated:
            return
        self._setup()
        log(f"apt-get update ({self.arch}, private state in {self.root})")
        self.apt("apt-get", "-q", "update")
        # An update that could not fetch some index still exits 0: no index means no packages.
        if not any((self.root / "state" / "lists").glob("*_Packages*")):
            raise PackagesUnavailable(f"apt-get update ({self.arch}) fetched no package index. "
                                      + _NET_HINT)
        self._updated = True

    def depends_of(self, package: str) -> list[str]:
        """Direct `Depends:` of `package` (e.g. linux-image-arm64 -> linux-image-6.1.0-N-arm64)."""
        self.update()
        out = self.apt("apt-cache", "depends", package)
        return [m.group(1) for m in re.finditer(r"^\s+Depends: (\S+)$", out, re.M)]

    def kernel_package(self) -> str:
        """The concrete linux-image-<version>-<arch> package the meta package points at."""
        deps = [d for d in self.depends_of(f"linux-image-{self.arch}")
                if d.startswith("linux-image-")]
        if not deps:
            raise HarnessError(f"apt-cache depends linux-image-{self.arch}: no linux-image-* "
                               "dependency. Hint: the Debian archive layout changed.")
        return deps[0]

    def fetch_closure(self, packages: list[str]) -> list[Path]:
        """Download `packages` and their dependency closure; return the .deb files."""
        self.update()
        before = set(self.archives.glob("*.deb"))
        log(f"downloading {len(packages)} packages and dependencies ({self.arch})")
        self.apt("apt-get", "-q", "-y", "--download-only", "install", *packages)
        # apt prints what it would install; take exactly that set from the archive cache.
        out = self.apt("apt-get", "-s", "-y", "install", *packages)
        names = {m.group(1): m.group(2)
                 for m in re.finditer(r"^Inst (\S+) \((\S+)", out, re.M)}
        debs = []
        for name, version in sorted(names.items()):
            pkg = name.split(":")[0]
            quoted = version.replace(":", "%3a")
            hits = list(self.archives.glob(f"{pkg}_{quoted}_*.deb"))
            if not hits:
                raise HarnessError(f"{pkg} {version}: not in {self.archives} after download "
                                   f"({len(before)} .debs before). Hint: remove {self.root} "
                                   "and retry.")
            debs.append(hits[0])
        return debs

    def download(self, package: str) -> Path:
        """Download one package without dependencies (used for the kernel)."""
        self.update()
        hits = sorted(self.archives.glob(f"{package}_*.deb"))
        if hits:
            return hits[-1]
        log(f"downloading {package} ({self.arch})")
        self.apt("apt-get", "-q", "download", package, cwd=self.archives)
        hits = sorted(self.archives.glob(f"{package}_*.deb"))
        if not hits:
            raise HarnessError(f"apt-get download {package}: no .deb in {self.archives}. "
                               "Hint: check the package name.")
        return hits[-1]


def extract_debs(debs: list[Path], dest: Path) -> None:
    """Unpack each .deb's data into dest (no maintainer scripts run)."""
    dest.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        p = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True,
                           text=True, timeout=300)
        if p.returncode != 0:
            raise HarnessError(f"dpkg-deb -x {deb.name}: exited {p.returncode}: "
                               f"{p.stderr.strip()}. Hint: delete the file and rebuild.")


def _pip(*args: str, timeout: float = 600) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise PackagesUnavailable(f"`{' '.join(cmd)}` took more than {timeout:.0f} s. "
                                  "Hint: check that PyPI is reachable.") from exc
    if p.returncode != 0:
        tail = p.stderr.strip()[-1500:]
        exc_type = (PackagesUnavailable if re.search(
            r"(No matching distribution|Could not fetch|ConnectionError|NewConnectionError|"
            r"Read timed out|Temporary failure)", tail) else HarnessError)
        raise exc_type(f"`{' '.join(cmd)}` exited {p.returncode}: {tail}. Hint: check that "
                       "PyPI is reachable and that the packages have wheels for the platform.")


def download_wheels(requirements: list[str], platform: str, dest: Path) -> list[Path]:
    """Binary wheels (with dependencies) for CPython 3.11 on `platform`, e.g.
    manylinux2014_aarch64 (numpy stops at 2.2.6 there)."""
    dest.mkdir(parents=True, exist_ok=True)
    log(f"pip download for {platform}: {' '.join(requirements)}")
    _pip("download", "-q", "--only-binary=:all:", "--platform", platform,
         "--python-version", "3.11", "--implementation", "cp", "-d", str(dest), *requirements)
    return sorted(dest.glob("*.whl"))


def install_wheels(wheels: list[Path], platform: str, target: Path) -> None:
    """Unpack wheels into a site directory of the guest (no dependency resolution, no scripts
    run); pip checks each wheel's tags against the guest's platform."""
    _pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--only-binary=:all:",
         "--platform", platform, "--python-version", "3.11", "--implementation", "cp",
         "--target", str(target), *map(str, wheels))
    for junk in target.glob("bin"):
        shutil.rmtree(junk, ignore_errors=True)
