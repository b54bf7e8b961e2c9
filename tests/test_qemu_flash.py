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
