"""A flash over the arm64 guest's UART: `edge-agent flash fw.elf --board stm32f405 --port
/dev/ttyAMA0` runs in the guest, the STM32 bootloader simulator answers on the host end of the
PL011's pty, and the host checks the simulated flash byte for byte against
`arm-none-eabi-objcopy -O binary` of the same ELF (built on the host by tests/firmware.py).

The same flash with `[reset] method = "gpio"` drives the reset sequence onto the guest's PL061
GPIO lines through the kernel's GPIO character device; the kernel's own tracepoint records it.

The pump below is the simulator's serving loop (firmware_tools.urlhandler.serve.serve_fd) with a
stop flag, since here QEMU, not the simulator, owns the pty.
"""

from __future__ import annotations

import json
import os
import re
import select
import threading
import time
import tty
from pathlib import Path

import firmware
import pytest
from qemu.build_arm64_guest import GuestImage
from qemu.guest import Arm64Guest
from qemu.skips import arm64_image_or_skip

from firmware_tools.simulator import Stm32Simulator, simulator_from_query

pytestmark = [pytest.mark.qemu, pytest.mark.tools, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def arm64() -> GuestImage:
    return arm64_image_or_skip("QEMU flash test")




class Pump:
    """Bytes between a pty and the simulator until stopped (QEMU's death is just silence)."""

    def __init__(self, sim: Stm32Simulator, path: str) -> None:
        self.sim = sim
        self.fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
        tty.setraw(self.fd)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Pump:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        os.close(self.fd)

    def _run(self) -> None:
        while not self.stop.is_set():
            ready = self.sim.next_ready()
            wait = 0.1 if ready is None else min(0.1, max(ready - time.monotonic(), 0.0))
            r, _, _ = select.select([self.fd], [], [], wait)
            if r:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # the guest side went away
                    data = b""
                if data:
                    self.sim.receive(data, time.monotonic())
                else:
                    time.sleep(0.05)
            out = self.sim.take_output(time.monotonic())
            if out:
                os.write(self.fd, out)


def _flash_in_guest(arm64: GuestImage, elf: Path, sim: Stm32Simulator, extra: str = ""
                    ) -> tuple[int | None, str, float]:
    cmd = ("python3 -m edge_agent --state-dir /tmp/state flash /ea/fw.elf --board stm32f405 "
           f"--port /dev/ttyAMA0 --json {extra}")
    t0 = time.monotonic()
    with Arm64Guest(cmd, uart=True, image=arm64, files={"/ea/fw.elf": elf.read_bytes()}) as g:
        assert g.uart_path is not None
        with Pump(sim, g.uart_path):
            r = g.wait(timeout=240)
    return r.rc, r.output, time.monotonic() - t0


def test_flash_over_the_guest_uart(arm64: GuestImage,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    fw = firmware.builder(tmp_path_factory)
    elf, expected = fw.elf("good"), fw.objcopy_bin("good").read_bytes()
    sim = simulator_from_query({"chip": "f405"})
    rc, output, wall = _flash_in_guest(arm64, elf, sim)
    assert rc == 0, output
    summary = json.loads(output[output.index("{"):])
    assert summary["went"] is True, summary
    assert sim.flash[: len(expected)] == expected
    assert set(sim.flash[len(expected):]) == {0xFF}, "bytes written past the image"
    assert sim.running_at == 0x08000000
    print(f"flash over the guest UART: {len(expected)} bytes, {wall:.1f} s wall (boot included)")


def test_flash_over_a_silent_uart_fails_with_a_hint(arm64: GuestImage,
                                                    tmp_path_factory: pytest.TempPathFactory
                                                    ) -> None:
    # The check can fail: a board that never answers the sync byte is an error, not a success.
    fw = firmware.builder(tmp_path_factory)
    sim = simulator_from_query({"chip": "f405", "silence": "sync"})
    rc, output, _ = _flash_in_guest(arm64, fw.elf("good"), sim)
    assert rc == 1, output
    assert "sync (0x7F) on /dev/ttyAMA0: no answer to two sync bytes" in output, output
    assert "Hint: check that BOOT0 is high" in output, output
    assert set(sim.flash) == {0xFF}


# Holds line 1 of the PL061, as another program using the chip would.
HOLD = ("import sys, time; sys.path.insert(0, '/opt/edge-agent')\n"
        "from firmware_tools.gpio_lines import GpioOutputs\n"
        "GpioOutputs('gpiochip0', {1: False}, consumer='someone else'); print('held', flush=True)\n"
        "time.sleep(600)\n")
TRACE = "/sys/kernel/debug/tracing"
# the kernel's gpio_value tracepoint: every level gpiolib drives onto a line, timestamped
_EVENT = re.compile(r"\s(\d+\.\d+): gpio_value: (\d+) set (\d)")


def _gpio_profile(label: str, invert: bool = False) -> bytes:
    repo = Path(__file__).resolve().parent.parent
    text = (repo / "board_profiles" / "stm32f405.toml").read_text()
    head = text[: text.index("[reset]")]
    flip = "true" if invert else "false"
    return (head + f'[reset]\nmethod = "gpio"\ngpio_chip = "{label}"\nreset_line = 0\n'
            f'boot0_line = 1\nreset_invert = {flip}\nboot0_invert = {flip}\n').encode()


def _section(out: str, name: str) -> str:
    start = out.index(f"== {name}\n") + len(name) + 4
    end = out.find("\n== ", start)
    return out[start: end if end >= 0 else len(out)]


def test_flash_resets_the_chip_through_the_guests_gpio_lines(
        arm64: GuestImage, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`[reset] method = "gpio"` on a real kernel's GPIO character device: the arm64 guest's
    PL061, NRST on line 0, BOOT0 on line 1. A line another consumer holds is an error naming
    that consumer; then a flash wired straight (the chip named by its label) and one through
    inverters each drive the reset sequence onto the pins, as the kernel's gpio_value
    tracepoint records it (every level set, timestamped by the kernel), and give the lines
    back (debugfs lists no line of theirs after)."""
    fw = firmware.builder(tmp_path_factory)
    elf, expected = fw.elf("good"), fw.objcopy_bin("good").read_bytes()
    flash = ("python3 -m edge_agent --state-dir /tmp/state flash /ea/fw.elf --board /ea/{0}.toml "
             "--port /dev/ttyAMA0 --json {1}")
    run = (f"echo > {TRACE}/trace; echo 1 > {TRACE}/events/gpio/gpio_value/enable; "
           f"{flash} > /tmp/{{0}}.json; echo \"{{0}} rc=$?\"; "
           f"echo 0 > {TRACE}/events/gpio/gpio_value/enable; "
           f"grep gpio_value {TRACE}/trace > /tmp/{{0}}.trace; "
           "grep -c 'edge-agent flash' /sys/kernel/debug/gpio > /tmp/{0}.held; ")
    cmd = ("mount -t debugfs none /sys/kernel/debug; "
           "echo \"== base\"; grep -o 'GPIOs [0-9]*' /sys/kernel/debug/gpio; "
           "python3 /ea/hold.py > /tmp/hold.log & H=$!; "
           "until grep -q held /tmp/hold.log; do sleep 0.1; done; "
           f"{flash.format('gpio', '')} > /tmp/busy.json; echo \"busy rc=$?\"; "
           "cat /tmp/busy.json; kill $H; wait $H; "
           + run.format("gpio", "--no-go") + run.format("inverted", "")  # the chip stays in its
           # bootloader for the second (the simulator cannot see the guest's lines reset it)
           + "for f in gpio inverted; do echo \"== $f\"; cat /tmp/$f.json; "
           "echo \"== $f trace\"; cat /tmp/$f.trace; echo \"== $f held\"; cat /tmp/$f.held; "
           "done")
    sim = simulator_from_query({"chip": "f405"})
    files = {"/ea/fw.elf": elf.read_bytes(), "/ea/gpio.toml": _gpio_profile("9030000.pl061"),
             "/ea/inverted.toml": _gpio_profile("gpiochip0", invert=True),
             "/ea/hold.py": HOLD.encode()}
    with Arm64Guest(cmd, uart=True, image=arm64, files=files) as g:
        assert g.uart_path is not None
        with Pump(sim, g.uart_path):
            r = g.wait(timeout=300)
    out = r.output
    assert r.rc == 0, out
    # the busy line: refused before a byte went out, naming who holds it
    assert "busy rc=1" in out, out
    assert ("GPIO chip gpiochip0 [9030000.pl061]: line 1 is in use by 'someone else'. Hint: "
            "stop what holds it") in out, out
    base = int(_section(out, "base").split()[1])
    # what the pins must do, (line, level) in order: requested released (NRST high, BOOT0 low),
    # BOOT0 high, NRST low, NRST high (the chip starts its bootloader), BOOT0 low before Go
    straight = [(0, 1), (1, 0), (1, 1), (0, 0), (0, 1), (1, 0)]
    pulses = []
    for name, levels in (("gpio", straight), ("inverted", [(o, 1 - v) for o, v in straight])):
        assert f"{name} rc=0" in out, out
        summary = json.loads(_section(out, name))
        assert summary["went"] is (name == "inverted"), summary
        events = [(float(t), int(n) - base, int(v))
                  for t, n, v in _EVENT.findall(_section(out, f"{name} trace"))]
        assert [(o, v) for _, o, v in events] == levels, (name, events)
        pulses.append(events[4][0] - events[3][0])  # NRST held low: pulse_s = 0.1
        assert pulses[-1] >= 0.095, (name, events)
        assert _section(out, f"{name} held").strip() == "0", out  # given back
    assert sim.flash[: len(expected)] == expected and sim.running_at == 0x08000000
    print(f"gpio reset: NRST low {pulses[0] * 1000:.1f} ms (straight), "
          f"{pulses[1] * 1000:.1f} ms (inverted)")
