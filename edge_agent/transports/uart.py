"""The UART session: one port shared by a console for people and COBS frames for MCUs.

Invariants owned here:
- Every byte from the port goes through `PortDemux` (frames.py): 0x00 opens a frame, anything
  else is console input (mode "auto"). Mode "console" sends everything to the console (a 0x00 is
  then noise); mode "machine" ignores console bytes (counted in `console_ignored`).
- The session talks to the daemon only through the narrow `Backend` protocol (defined in
  transports/backend.py, re-exported here), so the same scheduler, priorities, deadlines and
  records serve the UART and the Unix socket.
- Console: one generation at a time per port; Ctrl-C or `cancel` cancels it; the prompt comes
  back when a command has finished. Output goes through `OutputEncoder` (valid UTF-8, CRLF).
- `schema NAME JSON` registers a JSON Schema for this port's console (checked by the backend's
  `check_format` first; at most fr.MAX_SCHEMAS names); `gen --schema NAME` and `gen --json` ask
  for it as the HTTP API's `response_format`. Registrations live as long as the daemon process.
- Machine mode is `uart_machine.MachineSession`; RESUME replays from a token index, so a line
  drop loses nothing that the daemon still holds.
- Nothing here raises into the event loop: backend failures become an error line or ERROR frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

from edge_agent import __version__
from edge_agent.errors import EdgeAgentError
from edge_agent.protocol import console as con
from edge_agent.protocol import frames as fr
from edge_agent.transports.backend import (
    Backend,
    BackendError,
    Done,
    Failed,
    GenParams,
    StreamEvent,
    Token,
)
from edge_agent.transports.serial_link import LinkSettings, SerialLink
from edge_agent.transports.uart_machine import MachineSession

__all__ = [
    "GenParams",
    "Token",
    "Done",
    "Failed",
    "StreamEvent",
    "Backend",
    "BackendError",
    "UartSession",
    "UartTransport",
    "MODES",
]

MODES = ("auto", "console", "machine")
PROMPT = "edge> "
CHAT_PROMPT = "you> "


def _schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The HTTP API's response_format asking for output that follows `schema`."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value) or "-"
    return "-" if value is None else str(value)


class UartSession:
    """Sans-port session logic: `feed(bytes)` in, `write(bytes)` out, backend calls in between."""

    def __init__(self, backend: Backend, write: Callable[[bytes], None], *, name: str = "uart",
                 echo: bool = True, max_line: int = 512, mode: str = "auto", gap_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 extra_status: Callable[[], dict[str, Any]] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.backend = backend
        self.write = write
        self.name = name
        self.mode = mode
        self.clock = clock
        self.extra_status = extra_status or dict
        self.demux = fr.PortDemux(gap_s=gap_s)
        self.editor = con.LineEditor(max_line=max_line, echo=echo)
        self.enc = con.OutputEncoder()
        self.counters = {"console_ignored": 0, "console_generations": 0}
        self._gen: asyncio.Task[None] | None = None
        self._gen_id: str | None = None
        self._chat: list[dict[str, str]] | None = None
        self._chats = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.schemas: dict[str, dict[str, Any]] = {}  # console schema name -> JSON Schema
        self.machine = MachineSession(backend, write, name=name, stats=self.stats)
        self._timer: asyncio.TimerHandle | None = None
        self._last_console = True

    # -- input ---------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        now = self.clock()
        if self.mode == "console":
            self._console(data)
            return
        for ev in self.demux.feed(data, now):
            self._dispatch(ev)
        self._arm_timer(now)

    def _dispatch(self, ev: Any) -> None:
        if isinstance(ev, fr.ConsoleBytes):
            if self.mode == "machine":
                self.counters["console_ignored"] += len(ev.data)
            else:
                self._console(ev.data)
        elif isinstance(ev, fr.Frame):
            self._last_console = False
            self.machine.handle(ev)
        elif isinstance(ev, fr.FrameError):
            self._last_console = False
            self.machine.nak(ev.rid, ev.reason, ev.detail)
        elif isinstance(ev, fr.Abandoned) and self.mode == "auto" and self._last_console:
            what = (f"{ev.size} bytes of an unfinished frame" if ev.size
                    else "a break or a NUL byte")
            self._out(f"\nerror: {what} ignored. Hint: check the baud rate and cabling.\n")
            # a fresh prompt means a fresh line: what was typed before the noise is void, as
            # after Ctrl-C (it is no longer on the screen)
            self.editor.reset()
            self._prompt()

    def _arm_timer(self, now: float) -> None:
        deadline = self.demux.deadline()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is not None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(max(0.0, deadline - now) + 0.01, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = self.clock()
        for ev in self.demux.expire(now):
            self._dispatch(ev)
        self._arm_timer(now)

    def link_state(self, up: bool) -> None:
        """The port went down or came back: start clean (a half line or frame is void)."""
        self.demux = fr.PortDemux(gap_s=self.demux.gap_s, decoder=self.demux.decoder)
        self.editor.reset()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self.machine.close()
        tasks = [t for t in (self._gen, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **self.machine.counters, **self.demux.decoder.counters,
                **self.editor.counters}

    # -- console -------------------------------------------------------------------------------
    def _out(self, text: str) -> None:
        self.write(self.enc.text(text))

    def _prompt(self) -> None:
        self._out(CHAT_PROMPT if self._chat is not None else PROMPT)

    def _busy(self) -> bool:
        return self._gen is not None and not self._gen.done()

    def _console(self, data: bytes) -> None:
        self._last_console = True
        events, echo = self.editor.feed(data)
        if echo:
            self.write(echo)
        for ev in events:
            if isinstance(ev, con.Interrupt):
                self._interrupt()
            elif isinstance(ev, con.InputError):
                self._out(f"error: {ev.message}\n")
                if not self._busy():
                    self._prompt()
            elif self._chat is not None:
                self._chat_line(ev.text)
            else:
                self._command(ev.text)

    def _interrupt(self) -> None:
        if self._busy() and self._gen_id is not None:
            self.backend.cancel(self._gen_id)
            return  # the stream ends with "[cancelled]" and a prompt
        if self._chat is not None:
            self._out("(type /exit to leave the chat)\n")
        self._prompt()

    def _command(self, line: str) -> None:
        try:
            cmd = con.parse_command(line)
        except con.CommandError as exc:
            self._out(f"error: {exc}\n")
            if not self._busy():
                self._prompt()
            return
        if self._busy() and cmd.name not in ("cancel", ""):
            self._out("busy: a generation is running. Hint: Ctrl-C or `cancel` stops it.\n")
            return
        if cmd.name == "":
            if not self._busy():
                self._prompt()
            return
        try:
            self._run(cmd)
        except EdgeAgentError as exc:
            self._out(f"error: {exc}\n")
            self._prompt()

    def _run(self, cmd: con.Command) -> None:
        b = self.backend
        if cmd.name == "help":
            self._out(con.HELP + "\n")
        elif cmd.name == "version":
            self._out(f"edge-agent {__version__}\n")
        elif cmd.name == "status":
            status = {**b.status(), "link": {**self.extra_status(), **self.stats()}}
            self._out("".join(f"{k}: {_fmt(v)}\n" for k, v in status.items()))
        elif cmd.name == "flash status":
            flash = b.status().get("flash")
            self._out(f"flash: {_fmt(flash)}\n" if flash else "flash: no flash job on record\n")
        elif cmd.name == "models":
            rows = b.models()
            self._out("".join(f"{_fmt(m)}\n" for m in rows) or "no models configured\n")
        elif cmd.name == "jobs":
            rows = b.jobs()
            self._out("".join(f"{_fmt(j)}\n" for j in rows) or "no jobs\n")
        elif cmd.name in ("load", "unload"):
            self._spawn(self._lifecycle(cmd.name, cmd.arg))
            return
        elif cmd.name == "cancel":
            if self._busy() and self._gen_id is not None:
                b.cancel(self._gen_id)
                return
            self._out("nothing to cancel\n")
        elif cmd.name == "chat":
            self._chats += 1
            self._chat = []
            self._out("chat: every line is your turn; /exit leaves, Ctrl-C stops a reply.\n")
        elif cmd.name == "schema":
            self._schema(cmd)
        elif cmd.name == "gen":
            params = self._gen_params(cmd.options)
            if params is not None:
                self._start_gen(cmd.arg, params, cmd.options.priority)
                return
        self._prompt()

    def _schema(self, cmd: con.Command) -> None:
        if not cmd.arg:
            self._out("".join(f"{n}: {json.dumps(s, ensure_ascii=False)}\n"
                              for n, s in self.schemas.items()) or "no schemas registered\n")
        elif cmd.schema is None:
            known = self.schemas.get(cmd.arg)
            self._out(f"{cmd.arg}: {json.dumps(known, ensure_ascii=False)}\n" if known
                      else f"error: {self._no_schema(cmd.arg)}\n")
        elif cmd.arg not in self.schemas and len(self.schemas) >= fr.MAX_SCHEMAS:
            self._out(f"error: schema {cmd.arg}: {fr.MAX_SCHEMAS} schemas are registered on this"
                      " port already. Hint: reuse a name (registering it again replaces it).\n")
        else:
            try:
                self.backend.check_format(_schema_format(cmd.arg, cmd.schema))
            except EdgeAgentError as exc:
                self._out(f"error: schema {cmd.arg}: {exc}\n")
                return
            self.schemas[cmd.arg] = cmd.schema
            self._out(f"schema {cmd.arg} registered; use gen --schema {cmd.arg} TEXT\n")

    def _no_schema(self, name: str) -> str:
        known = ", ".join(self.schemas) or "none"
        return (f"no schema named {name!r} on this port (registered: {known}). Hint: register "
                f"it with `schema {name} {{...JSON Schema...}}`.")

    def _gen_params(self, opts: con.GenOptions) -> GenParams | None:
        """The request of `gen` options; None after an error line (an unknown schema)."""
        fmt: dict[str, Any] | None = None
        if opts.json_object:
            fmt = {"type": "json_object"}
        elif opts.schema is not None:
            schema = self.schemas.get(opts.schema)
            if schema is None:
                self._out(f"error: gen: {self._no_schema(opts.schema)}\n")
                return None
            fmt = _schema_format(opts.schema, schema)
        return GenParams(max_tokens=opts.max_tokens or 64, temperature=opts.temperature or 0.0,
                         seed=opts.seed, top_k=opts.top_k, top_p=opts.top_p, min_p=opts.min_p,
                         presence_penalty=opts.presence_penalty,
                         frequency_penalty=opts.frequency_penalty,
                         repeat_penalty=opts.repeat_penalty, repeat_last_n=opts.repeat_last_n,
                         response_format=fmt)

    async def _lifecycle(self, verb: str, name: str) -> None:
        self._out(f"{verb}ing {name} ...\n")
        try:
            result = await (self.backend.load(name) if verb == "load"
                            else self.backend.unload(name))
            self._out(f"{result}\n")
        except EdgeAgentError as exc:
            self._out(f"error: {exc}\n")
        self._prompt()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_gen(self, prompt: str | list[dict[str, str]], params: GenParams,
                   priority: int | None) -> None:
        session = (f"uart:{self.name}:chat{self._chats}" if self._chat is not None
                   else f"uart:{self.name}")
        try:
            rid = self.backend.submit(prompt, params, priority, None, session)
        except EdgeAgentError as exc:
            if self._chat:
                self._chat.pop()
            self._out(f"error: {exc}\n")
            self._prompt()
            return
        self.counters["console_generations"] += 1
        self._gen_id = rid
        self._gen = self._spawn(self._stream_console(rid))

    async def _stream_console(self, rid: str) -> None:
        text: list[str] = []
        trailer = ""
        try:
            async for ev in self.backend.events(rid, 0):
                if isinstance(ev, Token):
                    text.append(ev.text)
                    self.write(self.enc.text(ev.text))
                elif isinstance(ev, Done):
                    if ev.reason == "cancelled":
                        trailer = "[cancelled]\n"
                    break
                else:
                    trailer = f"error: {ev.message}\n"
                    break
        except EdgeAgentError as exc:
            trailer = f"error: {exc}\n"
        self.write(self.enc.flush() + self.enc.text("\n" + trailer))
        if self._chat is not None:
            reply = "".join(text)
            if reply and not trailer.startswith("error"):
                self._chat.append({"role": "assistant", "content": reply})
            elif self._chat and self._chat[-1]["role"] == "user":
                self._chat.pop()
        self._gen_id = None
        self._prompt()

    def _chat_line(self, line: str) -> None:
        assert self._chat is not None
        text = line.strip()
        if text in ("/exit", "/quit"):
            self._chat = None
            self._out("chat ended\n")
            self._prompt()
            return
        if self._busy():
            self._out("busy: the reply is still coming. Hint: Ctrl-C stops it.\n")
            return
        if not text:
            self._prompt()
            return
        self._chat.append({"role": "user", "content": text})
        self._start_gen(list(self._chat), GenParams(max_tokens=256), None)

class UartTransport:
    """A SerialLink and a UartSession glued together; what the daemon starts per port."""

    def __init__(self, settings: LinkSettings, backend: Backend, *, echo: bool = True,
                 max_line: int = 512, mode: str = "auto", gap_s: float = 0.5) -> None:
        self.session = UartSession(backend, self._write, name=settings.url, echo=echo,
                                   max_line=max_line, mode=mode, gap_s=gap_s,
                                   extra_status=self._link_stats)
        self.link = SerialLink(settings, self.session.feed, on_state=self.session.link_state)

    def _write(self, data: bytes) -> None:
        self.link.write(data)

    def _link_stats(self) -> dict[str, Any]:
        return self.link.stats()

    async def start(self, *, wait: bool = False) -> None:
        await self.link.start(wait=wait)

    async def close(self) -> None:
        await self.session.close()
        await self.link.close()

    def stats(self) -> dict[str, Any]:
        return {**self.link.stats(), **self.session.stats()}
