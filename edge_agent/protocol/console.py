"""Console mode on a UART (people with picocom / minicom): line editing, command grammar, output.

Sans-IO: `LineEditor.feed(bytes) -> (events, echo bytes)`, `parse_command(str) -> Command`,
`OutputEncoder` turns text or raw token bytes into wire bytes. No port, no asyncio.

Invariants owned here:
- A line ends at CR, LF or CRLF (the LF of a CRLF never ends a second, empty line).
- Backspace (0x08) and DEL (0x7f) remove one whole character; Ctrl-U clears the line; Ctrl-C
  gives `Interrupt` and drops the line; ANSI escape sequences (arrow keys) are swallowed.
- A line longer than `max_line` bytes is refused as a whole with `InputError` (never truncated);
  bytes are dropped until its end. Invalid UTF-8 or control bytes (binary noise) in a line give
  `InputError` naming the offset, and the editor carries on with the next line.
- `OutputEncoder` output is always valid UTF-8, never contains 0x00 or other C0 controls except
  TAB, and ends lines with CRLF; a multi-byte character split across token pieces is held back
  until complete.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field

__all__ = [
    "Line",
    "Interrupt",
    "InputError",
    "LineEditor",
    "Command",
    "GenOptions",
    "CommandError",
    "parse_command",
    "COMMANDS",
    "HELP",
    "OutputEncoder",
]

CTRL_C = 0x03
CTRL_U = 0x15
BS = 0x08
DEL = 0x7F
ESC = 0x1B


@dataclass(frozen=True)
class Line:
    text: str


@dataclass(frozen=True)
class Interrupt:
    pass


@dataclass(frozen=True)
class InputError:
    message: str


ConsoleEvent = Line | Interrupt | InputError


class LineEditor:
    """Bytes typed by a person -> Line / Interrupt / InputError events plus the echo to send."""

    def __init__(self, *, max_line: int = 512, echo: bool = True) -> None:
        self.max_line = max_line
        self.echo = echo
        self._buf = bytearray()
        self._overlong = 0  # bytes seen in a line already refused as too long
        self._noise: str | None = None  # first problem in the current line
        self._after_cr = False
        self._esc = 0  # 0: none, 1: after ESC, 2: inside CSI
        self.counters = {"lines": 0, "overlong": 0, "noise": 0, "interrupts": 0}

    def feed(self, data: bytes) -> tuple[list[ConsoleEvent], bytes]:
        events: list[ConsoleEvent] = []
        echo = bytearray()
        for b in data:
            after_cr, self._after_cr = self._after_cr, False
            if self._esc == 1:
                self._esc = 2 if b in (0x5B, 0x4F) else 0  # '[' or 'O' start a sequence
                continue
            if self._esc == 2:
                if 0x40 <= b <= 0x7E:
                    self._esc = 0
                continue
            if b in (0x0D, 0x0A):
                if b == 0x0A and after_cr:
                    continue
                self._after_cr = b == 0x0D
                echo += b"\r\n"
                events.append(self._end_line())
            elif b == CTRL_C:
                self._reset()
                self.counters["interrupts"] += 1
                echo += b"^C\r\n"
                events.append(Interrupt())
            elif b in (BS, DEL):
                if self._buf and not self._overlong:
                    cut = len(self._buf) - 1
                    while cut > 0 and self._buf[cut] & 0xC0 == 0x80:
                        cut -= 1
                    del self._buf[cut:]
                    if self.echo:
                        echo += b"\b \b"
            elif b == CTRL_U:
                if self._buf and self.echo:
                    echo += b"\b \b" * len(self._buf.decode("utf-8", "replace"))
                self._reset()
            elif b == ESC:
                self._esc = 1
            elif b == 0x09 or b >= 0x20:
                if self._overlong or len(self._buf) >= self.max_line:
                    self._overlong += 1
                    continue
                self._buf.append(b)
                if self.echo and b < 0x80:
                    echo.append(b)
                elif self.echo and b < 0xC0:  # last byte of a character completes it
                    echo += self._echo_char()
            else:
                if self._noise is None:
                    self._noise = f"control byte 0x{b:02x} at offset {len(self._buf)}"
        return events, bytes(echo)

    def _echo_char(self) -> bytes:
        start = len(self._buf) - 1
        while start > 0 and self._buf[start] & 0xC0 == 0x80:
            start -= 1
        piece = bytes(self._buf[start:])
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            return b""
        return piece

    def reset(self) -> None:
        """Forget a half-typed line (e.g. after the link dropped)."""
        self._reset()
        self._after_cr = False

    def _reset(self) -> None:
        self._buf.clear()
        self._overlong = 0
        self._noise = None
        self._esc = 0

    def _end_line(self) -> ConsoleEvent:
        raw, overlong, noise = bytes(self._buf), self._overlong, self._noise
        self._reset()
        if overlong:
            self.counters["overlong"] += 1
            return InputError(f"line refused: {len(raw) + overlong} bytes, longer than the "
                              f"{self.max_line}-byte limit; nothing was run. Hint: shorten it "
                              "(the limit is the serial.max_line setting).")
        if noise is not None:
            self.counters["noise"] += 1
            return InputError(f"line discarded: {noise} (binary noise or a wrong baud rate?). "
                              "Hint: check the terminal's baud rate and parity, then retype.")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.counters["noise"] += 1
            return InputError(f"line discarded: invalid UTF-8 ({exc.reason}) at byte offset "
                              f"{exc.start}. Hint: set the terminal to UTF-8 and check the "
                              "baud rate.")
        self.counters["lines"] += 1
        return Line(text)


# ----- command grammar --------------------------------------------------------------------------


@dataclass(frozen=True)
class GenOptions:
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    priority: int | None = None


@dataclass(frozen=True)
class Command:
    name: str  # one of COMMANDS, "" for an empty line
    arg: str = ""  # NAME for load/unload, TEXT for gen
    options: GenOptions = field(default_factory=GenOptions)


class CommandError(ValueError):
    """A console line that is not a valid command; the message ends with a Hint."""


COMMANDS = ("help", "status", "models", "load", "unload", "gen", "chat", "cancel", "jobs",
            "flash status", "version")

HELP = """\
commands:
  help                     this list
  status                   daemon, models, queue and link counters
  models                   models and their state
  load NAME | unload NAME  load or unload a model
  gen [--max-tokens N] [--temperature T] [--seed S] [--priority P] TEXT
                           generate from TEXT; tokens stream as they come
  chat                     a conversation: every line is a user turn until /exit
  cancel                   cancel the running generation (Ctrl-C does the same)
  jobs                     requests queued and running
  flash status             the last firmware flash job
  version                  daemon version"""

_OPTS = {
    "--max-tokens": ("max_tokens", int, 1, 4096),
    "--temperature": ("temperature", float, 0.0, 2.0),
    "--seed": ("seed", int, 0, 2**32 - 1),
    "--priority": ("priority", int, 0, 10),
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _parse_gen(rest: str) -> Command:
    values: dict[str, float | int] = {}
    while True:
        rest = rest.lstrip(" \t")
        if rest == "--" or rest.startswith(("-- ", "--\t")):
            rest = rest[2:]
            break
        m = re.match(r"(--[a-z-]+)(?:=(\S*)|[ \t]+(\S+)|$)", rest)
        if m is None:
            if rest.startswith("--"):
                bad = rest.split()[0]
                raise CommandError(f"gen: unknown option {bad!r}. Hint: options are "
                                   f"{', '.join(_OPTS)}; put -- before text that starts with --.")
            break
        opt = m.group(1)
        if opt not in _OPTS:
            raise CommandError(f"gen: unknown option {opt!r}. Hint: options are "
                               f"{', '.join(_OPTS)}; put -- before text that starts with --.")
        value = m.group(2) if m.group(2) is not None else m.group(3)
        if value is None:
            raise CommandError(f"gen: option {opt} needs a value. Hint: e.g. {opt} 1")
        key, kind, lo, hi = _OPTS[opt]
        try:
            number = kind(value)
        except ValueError:
            number = None
        if number is None or not lo <= number <= hi:
            what = "an integer" if kind is int else "a number"
            raise CommandError(f"gen: {opt} {value!r} is not {what} from {lo} to {hi}. "
                               f"Hint: e.g. {opt} {hi if kind is int and hi <= 10 else lo}")
        values[key] = number
        rest = rest[m.end():]
    text = rest.strip()
    if not text:
        raise CommandError("gen: no text to generate from. Hint: gen Tell me about UARTs")
    options = GenOptions(**values)  # type: ignore[arg-type]  # _OPTS gives each key its type
    return Command("gen", text, options)


def parse_command(line: str) -> Command:
    """One console line -> Command; raises CommandError with a Hint for anything else."""
    stripped = line.strip()
    if not stripped:
        return Command("")
    word, _, rest = stripped.partition(" ")
    word = word.lower()
    rest = rest.strip()
    if word == "gen":
        return _parse_gen(rest)
    if word in ("load", "unload"):
        if not rest or not _NAME_RE.match(rest):
            shown = repr(rest) if rest else "nothing"
            raise CommandError(f"{word}: needs one model NAME, got {shown}. "
                               "Hint: `models` lists the names.")
        return Command(word, rest)
    if word == "flash":
        if rest.lower() != "status":
            raise CommandError(f"flash: unknown sub-command {rest!r}. Hint: `flash status`; "
                               "flash a board with `edge-agent flash FILE.elf`.")
        return Command("flash status")
    if word in ("help", "status", "models", "chat", "cancel", "jobs", "version", "?"):
        if rest:
            raise CommandError(f"{word}: takes no arguments, got {rest!r}. Hint: type `{word}`.")
        return Command("help" if word == "?" else word)
    raise CommandError(f"unknown command {word!r}. Hint: type `help` for the list.")


# ----- output -----------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class OutputEncoder:
    """Text or raw token bytes -> wire bytes: valid UTF-8, CRLF line ends, no control bytes."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._cr = False  # a trailing CR held back: it may be the first half of CRLF

    def text(self, text: str) -> bytes:
        if self._cr:
            text = "\r" + text
            self._cr = False
        if text.endswith("\r"):
            text = text[:-1]
            self._cr = True
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        text = _CONTROL.sub("\ufffd", text)
        # Lone surrogates cannot be encoded; replace rather than fail.
        return text.replace("\n", "\r\n").encode("utf-8", "replace")

    def raw(self, data: bytes) -> bytes:
        """Token bytes that may end inside a multi-byte character (held back until complete)."""
        return self.text(self._utf8.decode(data))

    def flush(self) -> bytes:
        """End of a stream: release what is held (an incomplete character becomes U+FFFD)."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        out = self.text(tail)
        if self._cr:
            self._cr = False
            out += b"\r\n"
        return out

    def line(self, text: str = "") -> bytes:
        return self.text(text + "\n")
