"""A flash over the arm64 guest's UART: `edge-agent flash fw.elf --board stm32f405 --port
/dev/ttyAMA0` runs in the guest, the STM32 bootloader simulator answers on the host end of the
PL011's pty, and the host checks the simulated flash byte for byte against
`arm-none-eabi-objcopy -O binary` of the same ELF (built on the host by tests/firmware.py).

The pump below is the simulator's serving loop (firmware_tools.urlhandler.serve.serve_fd) with a
stop flag, since here QEMU, not the simulator, owns the pty.
"""

from __future__ import annotations

import json
import os
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


# Polls the kernel's view of the PL061's lines (debugfs) and logs every change of the lines held
# by `edge-agent flash`: "<ms> <offset>=<hi|lo> ..." (nothing held: "<ms> -").
WATCH = r'''
import re, sys, time
base, last, t0 = None, None, time.monotonic()
while True:
    text = open("/sys/kernel/debug/gpio").read()
    base = int(re.search(r"GPIOs (\d+)-", text).group(1))
    held = sorted((int(m.group(1)) - base, m.group(2)) for m in re.finditer(
        r"gpio-(\d+) \([^|]*\|edge-agent flash\s*\) out (hi|lo)", text))
    now = " ".join(f"{o}={v}" for o, v in held) or "-"
    if now != last:
        print(f"{(time.monotonic() - t0) * 1000:.0f} {now}", flush=True)
        last = now
    time.sleep(0.002)
'''
HOLD = ("import sys, time; sys.path.insert(0, '/opt/edge-agent')\n"
        "from firmware_tools.gpio_lines import GpioOutputs\n"
        "GpioOutputs('gpiochip0', {1: False}, consumer='someone else'); print('held', flush=True)\n"
        "time.sleep(600)\n")


def _gpio_profile(label: str, invert: bool = False) -> bytes:
    repo = Path(__file__).resolve().parent.parent
    text = (repo / "board_profiles" / "stm32f405.toml").read_text()
    head = text[: text.index("[reset]")]
    flip = "true" if invert else "false"
    return (head + f'[reset]\nmethod = "gpio"\ngpio_chip = "{label}"\nreset_line = 0\n'
            f'boot0_line = 1\nreset_invert = {flip}\nboot0_invert = {flip}\n').encode()


def _levels(out: str, section: str) -> list[tuple[float, str]]:
    text = out[out.index(f"== {section}"):].splitlines()[1:]
    rows = [line.split(" ", 1) for line in text[: next((k for k, line in enumerate(text)
                                                        if line.startswith("==")), len(text))]]
    return [(float(t), s) for t, s in rows if s]


def _check_sequence(states: list[tuple[float, str]], lo: str, hi: str) -> float:
    """The lines' changes (NRST on 0, BOOT0 on 1; `lo`/`hi`: the levels that mean low and high
    at the chip) are the reset into the bootloader; returns how long NRST was held low (ms)."""
    seen = [s.replace("hi", "H").replace("lo", "L").replace(lo, "l").replace(hi, "h")
            for _, s in states]
    assert seen[0] == "-" and seen[-1] == "-", seen  # not held before, given back after
    held = seen[1:-1]
    assert "0=l 1=l" not in held, held  # never reset with BOOT0 low (that runs the app)
    i = held.index("0=l 1=h")  # NRST pulled low with BOOT0 high ...
    assert held[i + 1:] == ["0=h 1=h", "0=h 1=l"], held  # ... released, BOOT0 low at the end
    # before it: requested released (NRST high, BOOT0 low), then BOOT0 high; microseconds
    # apart, so a poll may see neither
    assert held[:i] in ([], ["0=h 1=l"], ["0=h 1=h"], ["0=h 1=l", "0=h 1=h"]), held
    times = [t for t, _ in states[1:-1]]
    return times[i + 1] - times[i]


def test_flash_resets_the_chip_through_the_guests_gpio_lines(
        arm64: GuestImage, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`[reset] method = "gpio"` on a real kernel's GPIO character device: the arm64 guest's
    PL061, NRST on line 0, BOOT0 on line 1. A line another consumer holds is an error naming
    that consumer; then a flash wired straight (the chip named by its label) and one through
    inverters each drive the reset sequence, which debugfs shows as the chip sees it, and give
    the lines back."""
    fw = firmware.builder(tmp_path_factory)
    elf, expected = fw.elf("good"), fw.objcopy_bin("good").read_bytes()
    flash = ("python3 -m edge_agent --state-dir /tmp/state flash /ea/fw.elf --board /ea/gpio.toml "
             "--port /dev/ttyAMA0 --json")
    run = ("python3 /ea/watch.py > /tmp/{0}.log & W=$!; sleep 1; "
           f"{flash.replace('gpio.toml', '{0}.toml')} {{1}} > /tmp/{{0}}.json; "
           "echo \"{0} rc=$?\"; sleep 0.5; kill $W; ")
    cmd = ("mount -t debugfs none /sys/kernel/debug; "
           "python3 /ea/hold.py > /tmp/hold.log & H=$!; "
           "until grep -q held /tmp/hold.log; do sleep 0.1; done; "
           f"{flash} > /tmp/busy.json; echo \"busy rc=$?\"; cat /tmp/busy.json; kill $H; wait $H; "
           + run.format("gpio", "--no-go") + run.format("inverted", "")  # the chip stays in its
           # bootloader for the second (the simulator cannot see the guest's lines reset it)
           + "for f in gpio inverted; do echo \"== $f\"; cat /tmp/$f.json; "
           "echo \"== $f levels\"; cat /tmp/$f.log; done")
    sim = simulator_from_query({"chip": "f405"})
    files = {"/ea/fw.elf": elf.read_bytes(), "/ea/gpio.toml": _gpio_profile("9030000.pl061"),
             "/ea/inverted.toml": _gpio_profile("gpiochip0", invert=True),
             "/ea/watch.py": WATCH.encode(), "/ea/hold.py": HOLD.encode()}
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
    # the flashes: straight wiring (the chip by its label), then through inverters
    pulses = []
    for name, lo, hi in (("gpio", "L", "H"), ("inverted", "H", "L")):
        assert f"{name} rc=0" in out, out
        summary = json.loads(out[out.index("{", out.index(f"== {name}\n")):
                                 out.index(f"== {name} levels")])
        assert summary["went"] is (name == "inverted"), summary
        pulses.append(_check_sequence(_levels(out, f"{name} levels"), lo, hi))
        assert pulses[-1] >= 80, (pulses, out)  # pulse_s = 0.1 (the guest polls every ~2 ms)
    assert sim.flash[: len(expected)] == expected and sim.running_at == 0x08000000
    print(f"gpio reset: NRST low {pulses[0]:.0f} ms (straight), {pulses[1]:.0f} ms (inverted)")
