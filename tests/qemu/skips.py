"""Loud skips for the QEMU tests: a missing Debian tool or an image that cannot be built.

The only reasons a QEMU test may skip (tests/qemu/README.md); every message says what did not run
and how to get it.
"""

from __future__ import annotations

import shutil

import pytest

from qemu.build_arm64_guest import GuestImage, arm64_image
from qemu.build_systemd_guest import SystemdImage, systemd_image
from qemu.errors import PackagesUnavailable
from qemu.llama_aarch64 import TOOLCHAIN_PACKAGES, LlamaAarch64, llama_aarch64

__all__ = ["require_tool", "arm64_image_or_skip", "llama_aarch64_or_skip",
           "systemd_image_or_skip"]


def require_tool(tool: str, package: str, what: str) -> None:
    """Skip `what` loudly unless `tool` is on PATH (or in /usr/sbin, /sbin)."""
    if not (shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")):
        pytest.skip(f"!!! {tool} is not installed: {what} NOT RUN. Install the Debian package "
                    f"{package} (make deps-debian) !!!")


def arm64_image_or_skip(what: str, *tools: tuple[str, str]) -> GuestImage:
    """The cached arm64 guest image, after checking QEMU and any extra (tool, package) pairs."""
    for tool, package in (("qemu-system-aarch64", "qemu-system-arm"), *tools):
        require_tool(tool, package, what)
    try:
        return arm64_image()
    except PackagesUnavailable as exc:
        pytest.skip(f"!!! arm64 guest NOT BUILT, {what} NOT RUN: {exc} !!!")


def systemd_image_or_skip(what: str) -> SystemdImage:
    """The cached amd64 systemd guest image, after checking QEMU and mmdebstrap."""
    require_tool("qemu-system-x86_64", "qemu-system-x86", what)
    require_tool("mmdebstrap", "mmdebstrap", what)
    try:
        return systemd_image()
    except PackagesUnavailable as exc:
        pytest.skip(f"!!! systemd guest NOT BUILT, {what} NOT RUN: {exc} !!!")


def llama_aarch64_or_skip(what: str) -> LlamaAarch64:
    """The cached aarch64 llama-cpp-python build (cross-compiled first if needed), after
    checking the cross toolchain, cmake and ninja."""
    for tool, package in (("aarch64-linux-gnu-gcc", TOOLCHAIN_PACKAGES),
                          ("aarch64-linux-gnu-g++", TOOLCHAIN_PACKAGES),
                          ("cmake", "cmake"), ("ninja", "ninja-build")):
        require_tool(tool, package, what)
    try:
        return llama_aarch64()
    except PackagesUnavailable as exc:
        pytest.skip(f"!!! aarch64 llama-cpp-python NOT BUILT, {what} NOT RUN: {exc} !!!")
