"""pyserial URL handler `stm32sim://?chip=f405&state=/tmp/flash.bin&nack=0x31`.

Each open is a fresh simulated chip, in the bootloader (unless wired, below), not yet synced;
its flash starts erased unless `state=PATH` keeps it in a file across opens. Query keys:
`chip` (f405, f103, h750), `board` (a firmware_tools profile name, for its sector map),
`state`, the wiring of NRST and BOOT0 to DTR and RTS (`reset=dtr&boot0=rts`,
`reset_invert=1`, `boot0_invert=1`: see `firmware_tools.sim_board.Wiring`; a wired board
powers up running its application and enters the bootloader only when the host pulses NRST
with BOOT0 high), and the fault knobs of `firmware_tools.simulator.Faults`.

Invariants: reads honour the port timeout against the simulator's reply times (an erase that
takes 2 s is readable after 2 s); after a link drop every read and write raises
SerialException, as an unplugged USB adapter does.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from serial.serialutil import PortNotOpenError, SerialBase, SerialException

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from firmware_tools.simulator import Stm32Simulator

__all__ = ["Serial"]


class Serial(SerialBase):
    """A serial port whose far end is a `firmware_tools.simulator.Stm32Simulator`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sim: Stm32Simulator | None = None
        super().__init__(*args, **kwargs)

    def open(self) -> None:
        from firmware_tools.simulator import SimulatorError, simulator_from_query

        if self.is_open:
            raise SerialException("Port is already open.")
        if self.port is None:
            raise SerialException("Port must be configured before it can be used.")
        parts = urllib.parse.urlsplit(self.port)
        if parts.scheme != "stm32sim":
            raise SerialException(f"expected a stm32sim:// URL, got {self.port!r}")
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        options = {k: ",".join(v) for k, v in query.items()}
        try:
            self.sim = simulator_from_query(options)
        except SimulatorError as exc:
            raise SerialException(str(exc)) from exc
        self.is_open = True
        # the lines take the levels set before the open (pyserial asserts both by default),
        # as a tty's open does
        self._update_dtr_state()
        self._update_rts_state()

    def close(self) -> None:
        self.is_open = False
        self.sim = None

    def _reconfigure_port(self) -> None:
        """Any baud rate and parity are accepted (the simulator has no UART to mis-set)."""

    def _live(self) -> Stm32Simulator:
        if not self.is_open or self.sim is None:
            raise PortNotOpenError()
        if self.sim.dropped:
            raise SerialException(
                f"stm32sim: link dropped after {self.sim.received} bytes (drop_after knob)"
            )
        return self.sim

    @property
    def in_waiting(self) -> int:
        return self._live().ready_count(time.monotonic())

    def read(self, size: int = 1) -> bytes:
        sim = self._live()
        if size <= 0:
            return b""
        limit = 1 if sim.faults.bytewise else size
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        out = bytearray()
        while True:
            now = time.monotonic()
            out += sim.take_output(now, limit - len(out))
            if len(out) >= limit:
                break
            ready = sim.next_ready()
            if deadline is not None and now >= deadline:
                break
            if ready is None:
                if deadline is None:
                    raise SerialException("stm32sim: read without timeout would block forever")
                time.sleep(max(deadline - now, 0))
            else:
                wake = ready if deadline is None else min(ready, deadline)
                time.sleep(max(wake - now, 0))
            self._live()
        return bytes(out)

    def write(self, data: ReadableBuffer) -> int:
        sim = self._live()
        data = bytes(data)
        sim.receive(data, time.monotonic())
        return len(data)

    def reset_input_buffer(self) -> None:
        self._live().clear_output()

    def reset_output_buffer(self) -> None:
        self._live()

    def flush(self) -> None:
        self._live()

    def send_break(self, duration: float = 0.25) -> None:
        self._live()

    def _update_break_state(self) -> None:
        pass

    def _update_rts_state(self) -> None:
        self._live().modem_line("rts", bool(self.rts))

    def _update_dtr_state(self) -> None:
        self._live().modem_line("dtr", bool(self.dtr))

    @property
    def cts(self) -> bool:
        return True

    @property
    def dsr(self) -> bool:
        return True

    @property
    def ri(self) -> bool:
        return False

    @property
    def cd(self) -> bool:
        return True
