"""How a request ended: one frozen `Outcome`, set once by daemon/request_table.py.

Invariants owned here:
- `state` is the journal's and the scheduler's word for the end ("done", "failed", "cancelled",
  "expired"); `code` is the error code word the replies show (None for done and cancelled).
  The HTTP status of a code is protocol/api.py's END_STATUS, its UART code
  daemon/uart_backend.py's UART_END_CODES: nothing else derives either from an outcome.
- `kept`: the daemon stops with the journal on; the client is answered (503 `shutting_down`)
  but the request stays open in the journal and resumes at the next start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["EndCode", "EndState", "Outcome", "END_CODES"]

EndState = Literal["done", "failed", "cancelled", "expired"]
# every error code a request can end with (the edges map each: END_STATUS, UART_END_CODES)
EndCode = Literal["deadline_exceeded", "memory_pressure", "shutting_down", "runner_error",
                  "runner_failed", "model_failed", "budget_exceeded", "failed"]
END_CODES: tuple[str, ...] = get_args(EndCode)


@dataclass(frozen=True)
class Outcome:
    state: EndState
    code: EndCode | None = None  # None when done or cancelled
    message: str = ""
    finish_reason: str | None = None  # done: "stop" | "length"; cancelled: "cancelled"
    queued_s: float | None = None  # expired: the numbers its reply shows
    ran_s: float | None = None
    cancelled: str | None = None  # cancelled: why
    kept: bool = False  # failed shutting_down, but open in the journal (resumes)

    @property
    def error(self) -> bool:
        return self.code is not None

    @classmethod
    def done(cls, reason: str | None) -> Outcome:
        return cls("done", finish_reason=reason)

    @classmethod
    def failed(cls, code: EndCode, message: str, *, kept: bool = False) -> Outcome:
        return cls("failed", code, message, kept=kept)

    @classmethod
    def cancel(cls, why: str) -> Outcome:
        return cls("cancelled", finish_reason="cancelled", cancelled=why)

    @classmethod
    def expired(cls, message: str, queued_s: float, ran_s: float) -> Outcome:
        return cls("expired", "deadline_exceeded", message, queued_s=round(queued_s, 6),
                   ran_s=round(ran_s, 6))

    def extra(self) -> dict[str, float]:
        """The numbers an error reply carries beside its message."""
        return {k: v for k, v in (("queued_s", self.queued_s), ("ran_s", self.ran_s))
                if v is not None}
