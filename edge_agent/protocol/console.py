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
- `gen` options map one to one onto the request fields of the same name (docs/api.md); `--json`
  and `--schema NAME` exclude each other. `schema NAME JSON` carries a parsed JSON object (a
  JSON Schema); whether it compiles is the daemon's call.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field
from typing import Any

from edge_agent.protocol.frames import schema_from_json

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
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    json_object: bool = False  # --json: the reply is one JSON object
    schema: str | None = None  # --schema NAME: the reply follows the schema registered as NAME


@dataclass(frozen=True)
class Command:
    name: str  # one of COMMANDS, "" for an empty line
    arg: str = ""  # NAME for load/unload/schema, TEXT for gen
    options: GenOptions = field(default_factory=GenOptions)
    schema: dict[str, Any] | None = None  # `schema NAME JSON`: the JSON Schema to register


class CommandError(ValueError):
    """A console line that is not a valid command; the message ends with a Hint."""


COMMANDS = ("help", "status", "models", "load", "unload", "gen", "schema", "chat", "cancel",
            "jobs", "flash status", "version")

HELP = """\
commands:
  help                     this list
  status                   daemon, models, queue and link counters
  models                   models and their state
  load NAME | unload NAME  load or unload a model
  gen [--max-tokens N] [--temperature T] [--seed S] [--priority P] TEXT
                           generate from TEXT; tokens stream as they come
      [--top-k K] [--top-p P] [--min-p P] [--repeat-penalty R] [--repeat-last-n N]
      [--presence-penalty X] [--frequency-penalty X]
                           sampling controls (the HTTP API's fields of the same name)
      [--json | --schema NAME]
                           the reply is one JSON object / follows schema NAME
  schema [NAME [JSON]]     list the schemas, show NAME, or register JSON (a JSON Schema)
                           as NAME for gen --schema NAME (on this port, until restart)
  chat                     a conversation: every line is a user turn until /exit
  cancel                   cancel the running generation (Ctrl-C does the same)
  jobs                     requests queued and running
  flash status             the last firmware flash job
  version                  daemon version"""

# option -> (GenOptions field, type, lowest, highest, example for the hint)
_OPTS: dict[str, tuple[str, type, float, float, float]] = {
    "--max-tokens": ("max_tokens", int, 1, 4096, 1),
    "--temperature": ("temperature", float, 0.0, 2.0, 0.0),
    "--seed": ("seed", int, 0, 2**32 - 1, 0),
    "--priority": ("priority", int, 0, 10, 10),
    "--top-k": ("top_k", int, 0, 1 << 20, 40),
    "--top-p": ("top_p", float, 0.001, 1.0, 0.9),
    "--min-p": ("min_p", float, 0.0, 1.0, 0.05),
    "--repeat-penalty": ("repeat_penalty", float, 0.001, 100.0, 1.1),
    "--repeat-last-n": ("repeat_last_n", int, -1, 1 << 20, 64),
    "--presence-penalty": ("presence_penalty", float, -2.0, 2.0, 0.5),
    "--frequency-penalty": ("frequency_penalty", float, -2.0, 2.0, 0.5),
}
_FLAG_OPTS = {"--json": "json_object"}  # options without a value
_NAME_OPTS = {"--schema": "schema"}  # options whose value is a schema NAME
_ALL_OPTS = (*_OPTS, *_FLAG_OPTS, *_NAME_OPTS)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SCHEMA_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a response_format json_schema name


def _unknown_option(opt: str) -> CommandError:
    return CommandError(f"gen: unknown option {opt!r}. Hint: options are "
                        f"{', '.join(_ALL_OPTS)}; put -- before text that starts with --.")


def _parse_gen(rest: str) -> Command:
    values: dict[str, Any] = {}
    while True:
        rest = rest.lstrip(" \t")
        if rest == "--" or rest.startswith(("-- ", "--\t")):
            rest = rest[2:]
            break
        m = re.match(r"(--[a-z-]+)(?:=(\S*)|[ \t]+(\S+)|$)", rest)
        if m is None:
            if rest.startswith("--"):
                raise _unknown_option(rest.split()[0])
            break
        opt = m.group(1)
        if opt in _FLAG_OPTS:
            if m.group(2) is not None:
                raise CommandError(f"gen: option {opt} takes no value, got {m.group(2)!r}. "
                                   f"Hint: gen {opt} TEXT")
            values[_FLAG_OPTS[opt]] = True
            rest = rest[len(opt):]
            continue
        if opt not in _OPTS and opt not in _NAME_OPTS:
            raise _unknown_option(opt)
        value = m.group(2) if m.group(2) is not None else m.group(3)
        if value is None:
            raise CommandError(f"gen: option {opt} needs a value. Hint: e.g. "
                               f"{opt} {'person' if opt in _NAME_OPTS else 1}")
        rest = rest[m.end():]
        if opt in _NAME_OPTS:
            if not SCHEMA_NAME_RE.match(value):
                raise CommandError(f"gen: {opt} {value!r} is not a schema name (1..64 of "
                                   "a-z A-Z 0-9 _ -). Hint: `schema` lists the registered "
                                   "names.")
            values[_NAME_OPTS[opt]] = value
            continue
        key, kind, lo, hi, example = _OPTS[opt]
        try:
            number = kind(value)
        except ValueError:
            number = None
        if number is None or not lo <= number <= hi:
            what = "an integer" if kind is int else "a number"
            raise CommandError(f"gen: {opt} {value!r} is not {what} from {lo} to {hi}. "
                               f"Hint: e.g. {opt} {example}")
        values[key] = number
    if values.get("json_object") and values.get("schema"):
        raise CommandError("gen: --json and --schema together. Hint: --json for any JSON "
                           "object, --schema NAME for one following schema NAME.")
    text = rest.strip()
    if not text:
        raise CommandError("gen: no text to generate from. Hint: gen Tell me about UARTs")
    options = GenOptions(**values)
    return Command("gen", text, options)


def _parse_schema(rest: str) -> Command:
    if not rest:
        return Command("schema")
    name, _, text = rest.partition(" ")
    text = text.strip()
    if not SCHEMA_NAME_RE.match(name):
        raise CommandError(f"schema: {name!r} is not a schema name (1..64 of a-z A-Z 0-9 _ -). "
                           'Hint: schema person {"type": "object"}')
    if not text:
        return Command("schema", name)
    try:
        schema = schema_from_json(text.encode("utf-8"), f"schema {name}")
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    return Command("schema", name, schema=schema)


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
    if word == "schema":
        return _parse_schema(rest)
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
