"""firmware_tools/gpio_lines.py on this host: its structures and ioctl numbers are those of the
kernel's <linux/gpio.h> (compiled here with the host's compiler and run, and compiled for aarch64
with Debian's cross compiler against its arm64 headers), and a chip it cannot use is an error
naming it. Lines driven for real: tests/test_qemu_flash.py, on the arm64 guest's PL061.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from firmware_tools import gpio_lines as g
from firmware_tools.errors import FlashError

STRUCTS = {
    "gpiochip_info": (g.ChipInfo, ("name", "label", "lines")),
    "gpio_v2_line_attribute": (g.LineAttribute, ("id", "padding", "values")),
    "gpio_v2_line_config_attribute": (g.LineConfigAttribute, ("attr", "mask")),
    "gpio_v2_line_config": (g.LineConfig, ("flags", "num_attrs", "padding", "attrs")),
    "gpio_v2_line_request": (g.LineRequest, ("offsets", "consumer", "config", "num_lines",
                                             "event_buffer_size", "padding", "fd")),
    "gpio_v2_line_values": (g.LineValues, ("bits", "mask")),
    "gpio_v2_line_info": (g.LineInfo, ("name", "consumer", "offset", "num_attrs", "flags",
                                       "attrs", "padding")),
}
IOCTLS = {"GPIO_GET_CHIPINFO_IOCTL": g.GET_CHIPINFO, "GPIO_V2_GET_LINEINFO_IOCTL": g.GET_LINEINFO,
          "GPIO_V2_GET_LINE_IOCTL": g.GET_LINE, "GPIO_V2_LINE_GET_VALUES_IOCTL": g.GET_VALUES,
          "GPIO_V2_LINE_SET_VALUES_IOCTL": g.SET_VALUES}
CONSTANTS = {"GPIO_V2_LINE_FLAG_USED": g.FLAG_USED, "GPIO_V2_LINE_FLAG_ACTIVE_LOW":
             g.FLAG_ACTIVE_LOW, "GPIO_V2_LINE_FLAG_OUTPUT": g.FLAG_OUTPUT,
             "GPIO_V2_LINE_ATTR_ID_OUTPUT_VALUES": g.ATTR_OUTPUT_VALUES,
             "GPIO_V2_LINE_ATTR_ID_FLAGS": g.ATTR_FLAGS, "GPIO_MAX_NAME_SIZE": g.NAME_SIZE,
             "GPIO_V2_LINES_MAX": g.LINES_MAX, "GPIO_V2_LINE_NUM_ATTRS_MAX": g.ATTRS_MAX}


def _ours() -> dict[str, int]:
    """Every figure the module assumes, named as the C expression that gives it."""
    out = {f"sizeof(struct {name})": ctypes.sizeof(cls) for name, (cls, _) in STRUCTS.items()}
    for name, (cls, fields) in STRUCTS.items():
        for c_field, py_field in zip(fields, [f[0] for f in cls._fields_], strict=True):
            out[f"offsetof(struct {name}, {c_field})"] = getattr(cls, py_field).offset
    out.update({f"(unsigned long long){k}": v for k, v in {**IOCTLS, **CONSTANTS}.items()})
    return out


def _source(body: str) -> str:
    return f"#include <stddef.h>\n#include <stdio.h>\n#include <linux/gpio.h>\n{body}\n"


def test_the_layouts_and_ioctl_numbers_are_the_kernel_headers(tmp_path: Path) -> None:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("LOUD SKIP: no C compiler (make test installs gcc)")
    ours = _ours()
    prints = "\n".join(f'  printf("%s=%llu\\n", "{k}", (unsigned long long)({k}));'
                       for k in ours)
    src = tmp_path / "layout.c"
    src.write_text(_source(f"int main(void) {{\n{prints}\n  return 0;\n}}"))
    subprocess.run([cc, "-o", str(tmp_path / "layout"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True,
                         text=True).stdout
    theirs = dict(line.split("=", 1) for line in out.splitlines())
    assert {k: int(v) for k, v in theirs.items()} == ours
    # the board's architecture: the same figures must hold for aarch64 (checked at compile time)
    cross = shutil.which("aarch64-linux-gnu-gcc")
    if cross is None:
        pytest.skip("LOUD SKIP: no aarch64-linux-gnu-gcc (make test installs it)")
    checks = "\n".join(f'_Static_assert(({k}) == {v}ULL, "{k}");' for k, v in ours.items())
    src.write_text(_source(checks))
    subprocess.run([cross, "-c", "-o", str(tmp_path / "a.o"), str(src)], check=True)
    src.write_text(_source(checks.replace(f"== {ours['sizeof(struct gpio_v2_line_request)']}ULL",
                                          "== 1ULL", 1)))
    bad = subprocess.run([cross, "-c", "-o", str(tmp_path / "b.o"), str(src)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "sizeof(struct gpio_v2_line_request)" in bad.stderr


def test_a_chip_that_cannot_be_used_is_named_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(g.GpioError) as e:  # told by sysfs, not opened: some devices act on open
        g.GpioOutputs("/dev/null", {3: True}, consumer="test")
    assert str(e.value).startswith("'/dev/null' is not a GPIO chip (a mem device). Hint: name "
                                   "a chip as `gpiodetect` prints it")
    with pytest.raises(g.GpioError) as e:
        g.GpioOutputs(str(tmp_path), {3: True}, consumer="test")
    assert f"'{tmp_path}' is not a GPIO chip (not a character device)" in str(e.value)
    with pytest.raises(g.GpioError) as e:
        g.GpioOutputs(str(tmp_path / "gpiochip9"), {3: True}, consumer="test")
    assert f"GPIO chip '{tmp_path / 'gpiochip9'}': No such file or directory" in str(e.value)
    with pytest.raises(g.GpioError) as e:
        g.find_chip("pinctrl-rp1")
    assert str(e.value).startswith("GPIO chip 'pinctrl-rp1': no chip with that name or label")
    assert isinstance(e.value, FlashError)  # the flash CLI's and the daemon's errors
