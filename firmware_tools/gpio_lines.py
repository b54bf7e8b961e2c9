"""Output lines on a GPIO chip, through the kernel's GPIO character device (uAPI v2, Linux 5.10+).

What `[reset] method = "gpio"` drives NRST and BOOT0 with (firmware_tools/reset_lines.py).

Invariants this module owns:
- A chip is named as `gpiodetect` prints it: its device name ("gpiochip4"), its path
  ("/dev/gpiochip4") or its label ("pinctrl-rp1", which stays the same when the kernel numbers
  chips otherwise). A name that matches none is an error listing the chips there are.
- The lines are requested once, together, as outputs at their released level, under one
  consumer label (`gpioinfo` shows who holds them), and are held until `close`; closing the
  request gives them back to the kernel. Values are logical: a line configured active-low is
  driven low when set True (the kernel's GPIO_V2_LINE_FLAG_ACTIVE_LOW does the inversion).
- A path is opened only when it is a GPIO chip's character device (sysfs says which subsystem
  a device belongs to): opening some devices acts (a watchdog starts counting).
- Every failure is a `GpioError` naming the chip (and the line) and what to do: an offset past
  the chip's last line, a line another consumer holds (named, from the line's info), a device
  that is not a GPIO chip, no permission.
- The structures below are <linux/gpio.h>'s, laid out by ctypes (64-bit members 8-aligned, as
  the header's __aligned_u64 makes them on every architecture this runs on); the ioctl numbers
  are computed as _IOR/_IOWR compute them. tests/test_gpio_lines.py compiles the header and
  checks both.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from firmware_tools.errors import FlashError

__all__ = ["GpioError", "GpioOutputs", "chip_info", "find_chip"]

DEV = Path("/dev")
NAME_SIZE = 32  # GPIO_MAX_NAME_SIZE
LINES_MAX = 64  # GPIO_V2_LINES_MAX
ATTRS_MAX = 10  # GPIO_V2_LINE_NUM_ATTRS_MAX
FLAG_USED = 1 << 0  # GPIO_V2_LINE_FLAG_USED
FLAG_ACTIVE_LOW = 1 << 1
FLAG_OUTPUT = 1 << 3
ATTR_FLAGS = 1  # GPIO_V2_LINE_ATTR_ID_FLAGS
ATTR_OUTPUT_VALUES = 2  # GPIO_V2_LINE_ATTR_ID_OUTPUT_VALUES


class GpioError(FlashError):
    """A GPIO chip or line that cannot be driven (the message says which and what to do)."""


class ChipInfo(ctypes.Structure):  # struct gpiochip_info
    _fields_ = [("name", ctypes.c_char * NAME_SIZE), ("label", ctypes.c_char * NAME_SIZE),
                ("lines", ctypes.c_uint32)]


class LineAttribute(ctypes.Structure):  # struct gpio_v2_line_attribute (the union as u64)
    _fields_ = [("id", ctypes.c_uint32), ("padding", ctypes.c_uint32),
                ("value", ctypes.c_uint64)]


class LineConfigAttribute(ctypes.Structure):  # struct gpio_v2_line_config_attribute
    _fields_ = [("attr", LineAttribute), ("mask", ctypes.c_uint64)]


class LineConfig(ctypes.Structure):  # struct gpio_v2_line_config
    _fields_ = [("flags", ctypes.c_uint64), ("num_attrs", ctypes.c_uint32),
                ("padding", ctypes.c_uint32 * 5), ("attrs", LineConfigAttribute * ATTRS_MAX)]


class LineRequest(ctypes.Structure):  # struct gpio_v2_line_request
    _fields_ = [("offsets", ctypes.c_uint32 * LINES_MAX), ("consumer", ctypes.c_char * NAME_SIZE),
                ("config", LineConfig), ("num_lines", ctypes.c_uint32),
                ("event_buffer_size", ctypes.c_uint32), ("padding", ctypes.c_uint32 * 5),
                ("fd", ctypes.c_int32)]


class LineValues(ctypes.Structure):  # struct gpio_v2_line_values
    _fields_ = [("bits", ctypes.c_uint64), ("mask", ctypes.c_uint64)]


class LineInfo(ctypes.Structure):  # struct gpio_v2_line_info
    _fields_ = [("name", ctypes.c_char * NAME_SIZE), ("consumer", ctypes.c_char * NAME_SIZE),
                ("offset", ctypes.c_uint32), ("num_attrs", ctypes.c_uint32),
                ("flags", ctypes.c_uint64), ("attrs", LineAttribute * ATTRS_MAX),
                ("padding", ctypes.c_uint32 * 4)]


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0xB4 << 8) | nr  # asm-generic/ioctl.h


_READ, _RW = 2, 3
GET_CHIPINFO = _ioc(_READ, 0x01, ctypes.sizeof(ChipInfo))
GET_LINEINFO = _ioc(_RW, 0x05, ctypes.sizeof(LineInfo))
GET_LINE = _ioc(_RW, 0x07, ctypes.sizeof(LineRequest))
GET_VALUES = _ioc(_RW, 0x0E, ctypes.sizeof(LineValues))
SET_VALUES = _ioc(_RW, 0x0F, ctypes.sizeof(LineValues))


def _subsystem(path: Path) -> str | None:
    """The kernel subsystem of character device `path` ("gpio" for a chip), None if unknown."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # the open below names the error
    if not stat.S_ISCHR(st.st_mode):
        return "not a character device"
    link = Path(f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/subsystem")
    try:
        return os.path.basename(os.readlink(link))
    except OSError:
        return None  # no sysfs here: the chip-info ioctl decides


def _open(path: Path) -> int:
    kind = _subsystem(path)
    if kind is not None and kind != "gpio":  # not opened: opening some devices acts
        what = kind if " " in kind else f"a {kind} device"
        raise GpioError(f"{str(path)!r} is not a GPIO chip ({what}). Hint: name a chip as "
                        "`gpiodetect` prints it: gpiochipN, /dev/gpiochipN or its label.")
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except PermissionError:
        raise GpioError(
            f"GPIO chip {str(path)!r}: permission denied (uid {os.getuid()}). Hint: give the "
            f"user access, e.g. a udev rule `SUBSYSTEM==\"gpio\", KERNEL==\"gpiochip*\", "
            f"GROUP=\"gpio\", MODE=\"0660\"` and the user in group gpio (Raspberry Pi OS has "
            "both), or run as root.") from None
    except OSError as exc:
        raise GpioError(f"GPIO chip {str(path)!r}: {exc.strerror}. Hint: `gpiodetect` lists "
                        "the chips (package gpiod).") from None


def chip_info(fd: int, path: Path) -> ChipInfo:
    info = ChipInfo()
    try:
        fcntl.ioctl(fd, GET_CHIPINFO, info, True)
    except OSError as exc:
        raise GpioError(f"{str(path)!r} is not a GPIO chip ({exc.strerror}). Hint: name a "
                        "chip as `gpiodetect` prints it: gpiochipN, /dev/gpiochipN or its "
                        "label.") from None
    return info


def _chips() -> list[tuple[Path, str, int]]:
    """(path, label, lines) of every chip this process may open."""
    out = []
    for path in sorted(DEV.glob("gpiochip*"), key=lambda p: (len(p.name), p.name)):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = chip_info(fd, path)
            out.append((path, info.label.decode(errors="replace"), int(info.lines)))
        except GpioError:
            pass
        finally:
            os.close(fd)
    return out


def find_chip(chip: str) -> Path:
    """The device of `chip`: a path, a device name in /dev, or a chip label."""
    if "/" in chip:
        return Path(chip)
    if (DEV / chip).exists():
        return DEV / chip
    chips = _chips()
    for path, label, _ in chips:
        if label == chip:
            return path
    there = ", ".join(f"{p.name} [{label}] ({n} lines)" for p, label, n in chips)
    raise GpioError(f"GPIO chip {chip!r}: no chip with that name or label"
                    + (f" (there are: {there})" if there else
                       f" (this system has no GPIO chip this user may open in {DEV})")
                    + ". Hint: set gpio_chip under [reset] to one `gpiodetect` lists.")


class GpioOutputs:
    """`lines` (offset -> active_low) of `chip` held as outputs, all released (False) at first."""

    def __init__(self, chip: str, lines: Mapping[int, bool], consumer: str) -> None:
        self.path = find_chip(chip)
        self.offsets = list(lines)
        fd = _open(self.path)
        try:
            info = chip_info(fd, self.path)
            self.name = f"GPIO chip {info.name.decode()} [{info.label.decode()}]"
            for off in self.offsets:
                if off >= info.lines:
                    raise GpioError(f"{self.name}: line {off} does not exist (the chip has "
                                    f"lines 0..{info.lines - 1}). Hint: set reset_line / "
                                    "boot0_line under [reset] to offsets `gpioinfo` lists "
                                    "for this chip.")
            self.fd = self._request(fd, lines, consumer)
        finally:
            os.close(fd)

    def _request(self, fd: int, lines: Mapping[int, bool], consumer: str) -> int:
        req = LineRequest()
        for i, off in enumerate(self.offsets):
            req.offsets[i] = off
        req.num_lines = len(self.offsets)
        req.consumer = consumer.encode()[: NAME_SIZE - 1]
        req.config.flags = FLAG_OUTPUT
        low = [i for i, off in enumerate(self.offsets) if lines[off]]
        n = 0
        if low:  # the active-low lines get their own flags
            a = req.config.attrs[n]
            a.attr.id, a.attr.value = ATTR_FLAGS, FLAG_OUTPUT | FLAG_ACTIVE_LOW
            a.mask = sum(1 << i for i in low)
            n += 1
        a = req.config.attrs[n]  # every line released: logical 0
        a.attr.id, a.attr.value, a.mask = ATTR_OUTPUT_VALUES, 0, (1 << len(self.offsets)) - 1
        req.config.num_attrs = n + 1
        try:
            fcntl.ioctl(fd, GET_LINE, req, True)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise GpioError(f"{self.name}: {self._holders(fd)}. Hint: stop what holds "
                                "it (`gpioinfo` names the consumer), or wire another line.") \
                    from None
            raise GpioError(f"{self.name}: lines {self.offsets} cannot be requested as "
                            f"outputs ({exc.strerror}). Hint: check the offsets with "
                            "`gpioinfo`.") from None
        return int(req.fd)

    def _holders(self, fd: int) -> str:
        held = []
        for off in self.offsets:
            info = LineInfo()
            info.offset = off
            try:
                fcntl.ioctl(fd, GET_LINEINFO, info, True)
            except OSError:
                continue
            if info.flags & FLAG_USED:
                who = info.consumer.decode(errors="replace") or "the kernel"
                held.append(f"line {off} is in use by {who!r}")
        return "; ".join(held) or f"lines {self.offsets} are busy"

    def _bits(self, values: Mapping[int, bool]) -> LineValues:
        v = LineValues()
        for off, on in values.items():
            i = self.offsets.index(off)
            v.mask |= 1 << i
            v.bits |= int(on) << i
        return v

    def set(self, values: Mapping[int, bool]) -> None:
        """Drive the lines in `values` (logical levels) in one ioctl."""
        try:
            fcntl.ioctl(self.fd, SET_VALUES, self._bits(values), True)
        except OSError as exc:
            raise GpioError(f"{self.name}: setting lines {dict(values)} failed: "
                            f"{exc.strerror}.") from None

    def get(self) -> dict[int, bool]:
        """The lines' logical levels as the chip reads them back."""
        v = self._bits(dict.fromkeys(self.offsets, False))
        fcntl.ioctl(self.fd, GET_VALUES, v, True)
        return {off: bool(v.bits >> i & 1) for i, off in enumerate(self.offsets)}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
