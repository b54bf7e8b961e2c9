"""NRST and BOOT0 driven from the serial adapter's modem lines (`[reset] method = "dtr-rts"`)
or from the host's GPIO lines (`method = "gpio"`, firmware_tools/gpio_lines.py).

Invariants this module owns:
- dtr-rts: a line is asserted when pyserial's `dtr`/`rts` is True; `reset_invert`/`boot0_invert`
  flip that. gpio: an asserted reset line is driven low and an asserted BOOT0 line high (a pin
  wired straight to the chip); the invert flags flip that (a transistor or an inverter between
  them). Either way an asserted reset line holds NRST low and an asserted BOOT0 line holds BOOT0
  high (`LineControl`'s contract, the one board profiles are written against).
- The port opens with both pins released (`OPEN_LEVELS`), not with pyserial's default of both
  lines asserted, which would hold the chip in reset from the open on. GPIO lines are requested
  at the reset, as outputs at their released levels, and held until `close`.
- Into the bootloader: BOOT0 high, NRST low for `pulse_s`, NRST released (the chip samples
  BOOT0 then), `settle_s` before the first 0x7F. Out of it: BOOT0 low before Go, so the next
  reset (a watchdog, a power cycle) boots the new image; `run_application` pulses NRST with
  BOOT0 low (the board runs what its flash holds).
- A port without modem lines (a pseudo-terminal, where the ioctl fails) is not an error: the
  caller gets a note saying the board must be put in its bootloader by hand. GPIO lines that
  cannot be had (no such chip or line, held by another consumer, no permission) are a
  `GpioError` naming them: the profile says they are wired, so that is fixable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from firmware_tools.gpio_lines import GpioOutputs
from firmware_tools.profiles import LineControl

__all__ = ["ResetLines", "open_levels"]


def _level(asserted: bool, invert: bool) -> bool:
    return asserted != invert


def open_levels(control: LineControl) -> dict[str, bool] | None:
    """The `dtr`/`rts` values to open the port with (both pins released), or None when the
    profile does not wire the modem lines."""
    if control.method != "dtr-rts":
        return None
    return {str(control.reset_line): _level(False, control.reset_invert),
            str(control.boot0_line): _level(False, control.boot0_invert)}


class ResetLines:
    """Drives a board's NRST and BOOT0 through `port`'s DTR and RTS per `control`."""

    def __init__(self, port: Any, control: LineControl, name: str,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.port = port
        self.control = control
        self.name = name
        self.sleep = sleep
        self.driven = control.method in ("dtr-rts", "gpio")
        self.boot0_high = False
        self.gpio: GpioOutputs | None = None

    def _drive(self, line: str | int | None, asserted: bool, invert: bool) -> None:
        if self.gpio is not None:  # polarity given to the kernel when the lines were requested
            self.gpio.set({int(line or 0): asserted})
        else:
            setattr(self.port, str(line), _level(asserted, invert))

    def _set(self, reset: bool | None = None, boot0: bool | None = None) -> None:
        c = self.control
        if boot0 is not None:
            self._drive(c.boot0_line, boot0, c.boot0_invert)
            self.boot0_high = boot0
        if reset is not None:
            self._drive(c.reset_line, reset, c.reset_invert)

    def _pulse(self, boot0: bool) -> None:
        self._set(boot0=boot0, reset=True)
        self.sleep(self.control.pulse_s)
        self._set(reset=False)
        self.sleep(self.control.settle_s)

    def enter_bootloader(self) -> str | None:
        """Reset the chip into its ROM bootloader. Returns a note for the user when this
        profile or this port cannot do it (the board must be in its bootloader already)."""
        c = self.control
        if c.method == "gpio" and self.gpio is None:
            # logical True = asserted: NRST low unless inverted, BOOT0 high unless inverted
            self.gpio = GpioOutputs(str(c.gpio_chip), {int(c.reset_line or 0): not c.reset_invert,
                                                       int(c.boot0_line or 0): c.boot0_invert},
                                    consumer="edge-agent flash")
        if not self.driven:
            return None
        try:
            self._pulse(boot0=True)
        except OSError as exc:  # ENOTTY/EINVAL: no modem control lines on this device
            self.driven = False
            return (f"{self.name} has no modem control lines ({exc.strerror or exc}): "
                    f"[reset] {c.reset_line}/{c.boot0_line} not driven; the board must be in "
                    "its bootloader already (BOOT0 high, then reset)")
        return None

    def release_boot0(self) -> None:
        """BOOT0 low, so the next reset boots the flash (before Go: the chip keeps running)."""
        if self.driven and self.boot0_high:
            self._set(boot0=False)

    def run_application(self) -> None:
        """Pulse NRST with BOOT0 low: the chip leaves the bootloader and runs its flash."""
        if self.driven:
            self._pulse(boot0=False)

    def close(self) -> None:
        """Give GPIO lines back to the kernel (the modem lines go with the port)."""
        if self.gpio is not None:
            self.gpio.close()
            self.gpio = None

    def wiring(self) -> str:
        """The lines this profile drives, for a hint."""
        c = self.control
        inv = {True: " inverted", False: ""}
        if self.gpio is not None:
            return (f"{self.gpio.name}: NRST on line {c.reset_line}{inv[c.reset_invert]}, "
                    f"BOOT0 on line {c.boot0_line}{inv[c.boot0_invert]}")
        return (f"the adapter: NRST on {c.reset_line}{inv[c.reset_invert]}, "
                f"BOOT0 on {c.boot0_line}{inv[c.boot0_invert]}")
