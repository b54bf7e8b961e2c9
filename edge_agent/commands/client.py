"""`edge-agent status`, `edge-agent models` and `edge-agent chat`: the daemon's CLI client.

The socket is --socket, else server.socket from the layered configuration (config file,
EDGE_AGENT_SERVER__SOCKET, ...), whose default follows the state directory (edge_agent.paths):
inside a checkout, the `.state/edge-agent.sock` that `make run` serves on.
Data goes to stdout (JSON with --json), diagnostics to stderr.
`status` exits 0 only when the daemon is serving (1 when unreachable or not ready), so scripts
can wait on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from edge_agent.client import DaemonClient, DaemonUnavailable
from edge_agent.config import Config, load_config

__all__ = ["register", "run_status", "run_models", "run_chat", "render_health", "client_for",
           "daemon_socket"]


def _seconds(text: str) -> float:
    """--timeout: a finite number of seconds above 0 (a socket cannot wait 0, -1 or NaN s)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} seconds: give a number above 0, e.g. 30")
    return value


def _common(parser: argparse.ArgumentParser, timeout: float = 30.0) -> None:
    parser.add_argument("--socket", metavar="PATH",
                        help="daemon socket (default: server.socket from the configuration, "
                        "else STATE_DIR/edge-agent.sock; see `edge-agent --help`)")
    parser.add_argument("--config", metavar="FILE",
                        help="configuration file (default: /etc/edge-agent/config.toml)")
    parser.add_argument("--timeout", type=_seconds, default=timeout, metavar="S",
                        help="seconds to wait for each reply from the daemon "
                        "(default: %(default)s)")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser("status", help="show the daemon's state (exit 0 when serving)",
                            description="Ask the daemon for /health and print it.")
    _common(status)
    status.add_argument("--json", action="store_true", help="print the /health JSON")
    status.set_defaults(func=run_status)

    models = sub.add_parser("models", help="list the daemon's models",
                            description="List the models the daemon knows (GET /v1/models).")
    _common(models)
    models.add_argument("--json", action="store_true", help="print the model list as JSON")
    models.set_defaults(func=run_models)

    chat = sub.add_parser(
        "chat", help="chat with a model through the daemon",
        description="Read lines from stdin, stream the replies; the conversation is kept "
        "for the session. /reset starts over, /exit (or end of input) quits.",
    )
    _common(chat, timeout=600.0)  # the first reply may wait for a model load
    chat.add_argument("--model", help="model name (default: the daemon's default model)")
    chat.add_argument("--system", metavar="TEXT", help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256, metavar="N",
                      help="tokens per reply (default: %(default)s)")
    chat.add_argument("--temperature", type=float, metavar="T", help="sampling temperature")
    chat.add_argument("--seed", type=int, help="sampling seed")
    chat.set_defaults(func=run_chat)


def daemon_socket(args: argparse.Namespace, config: str | None = None) -> Path:
    """--socket, else server.socket from the configuration, whose default follows the state
    directory (--state-dir and the rest of edge_agent.paths' rule): the socket `make run` or
    the systemd unit serves on, with no flags."""
    if getattr(args, "socket", None):
        return Path(args.socket)
    return configured(args, config).server.socket


def configured(args: argparse.Namespace, config: str | None = None) -> Config:
    """The daemon's configuration as a client command sees it: the file (`config`, else
    --config, else the default), EDGE_AGENT_* variables, and --state-dir over
    server.state_dir; paths are not checked (the command may run where models are not)."""
    state = getattr(args, "state_dir", None)
    overrides = {"server.state_dir": state} if state else {}
    return load_config(config if config is not None else getattr(args, "config", None),
                       env=os.environ, check_paths=False, overrides=overrides,
                       flags={"server.state_dir": "--state-dir"})


def engine_for(args: argparse.Namespace, config: Config | None = None) -> str:
    """--engine, else runtime.engine from the configuration (`config`, else `configured`;
    itself "auto" by default): a command that runs or describes a model in this process
    picks the daemon's engine."""
    if args.engine:
        return str(args.engine)
    return (config or configured(args)).runtime.engine


def client_for(args: argparse.Namespace) -> DaemonClient:
    return DaemonClient(daemon_socket(args), timeout=args.timeout)


# ----- status ----------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return "-" if value is None else str(value)


def _inline(table: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_scalar(v)}" for k, v in table.items()) or "-"


def _table(rows: Sequence[tuple[str, ...]], indent: str = "") -> list[str]:
    """Rows as left-aligned columns two spaces apart (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def _mib(n: Any) -> str:
    return f"{n / 2**20:.0f} MiB" if isinstance(n, (int, float)) else "?"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _queue_line(q: dict[str, Any]) -> str:
    line = f"depth {q.get('depth', '?')} of {q.get('queue_max', '?')}"
    counts = [f"{k} {q[k]}" for k in ("queued", "running", "done", "expired", "cancelled",
                                      "failed") if k in q]
    return line + (f" ({', '.join(counts)})" if counts else "")


def _pressure_line(p: dict[str, Any]) -> str:
    line = f"{p.get('name', '?')} (stage {p.get('stage', '?')})"
    line += ", admitting" if p.get("admitting", True) else ", refusing new requests"
    if p.get("source"):
        trigger = f" trigger \"{p['trigger']}\"" if p.get("trigger") else ""
        line += f"; {p.get('kind', 'watching')}{trigger} on {p['source']}, " \
                f"{p.get('events', 0)} events"
    if p.get("error"):
        line += f"; error: {p['error']}"
    return line


def _cgroup_lines(c: dict[str, Any]) -> list[str]:
    if not c.get("available"):
        lines = [f"not available: {c.get('reason') or 'unknown reason'}"]
        if c.get("fix"):
            lines.append(f"fix: {c['fix']}")
        return lines
    line = f"{c.get('base') or '?'} (policy {c.get('policy', '?')}"
    if c.get("service_memory_max") is not None:
        line += f", service memory.max {_scalar(c['service_memory_max'])}"
    kills = c.get("oom_kills") or {}
    line += f", OOM kills {sum(v for v in kills.values() if isinstance(v, int))})"
    return [line] + [f"warning: {w}" for w in c.get("warnings") or []]


def _journal_line(j: dict[str, Any]) -> str:
    if not j.get("enabled", True):
        return "off"
    line = f"{j.get('path', '?')} (synchronous {j.get('synchronous', '?')}, " \
           f"ack {j.get('ack', '?')})"
    if isinstance(j.get("steps"), int):
        line += f", {j['steps']} decode steps committed"
    if j.get("quarantined"):
        line += f"; a corrupt journal was moved aside to {j['quarantined']}"
    return line


def _model_rows(models: Any) -> list[str]:
    if isinstance(models, dict):
        models = [{"name": name, **(v if isinstance(v, dict) else {"state": v})}
                  for name, v in models.items()]
    if not isinstance(models, list) or not models:
        return []
    table = [("NAME", "STATE", "LOADS", "RUNNING", "QUEUED", "BATCH", "CONTEXT", "KV FREE",
              "WEIGHTS LOCKED")]
    notes: list[str] = []
    for m in models:
        if not isinstance(m, dict):
            m = {"name": _scalar(m)}
        name = str(m.get("name") or m.get("id") or "?")
        lock = m.get("mlock") or {}
        if lock.get("locked"):
            locked = f"{_mib(lock.get('locked_bytes'))} of {_mib(lock.get('weight_bytes'))}"
        elif lock:
            locked = f"no ({lock.get('policy', '?')})"
        else:
            locked = "-"
        kv = (f"{m['free_blocks']}/{m['total_blocks']}"
              if "free_blocks" in m and "total_blocks" in m else "-")
        table.append((name, _scalar(m.get("state")), _scalar(m.get("loads")),
                      _scalar(m.get("active")), _scalar(m.get("queued")),
                      _scalar(m.get("max_batch")), _scalar(m.get("context")), kv, locked))
        if m.get("reason"):
            notes.append(f"  {name}: {m['reason']}")
        if lock.get("error"):
            notes.append(f"  {name}: weights not locked: {lock['error']}")
    return ["models:", *_table(table, indent="  "), *notes]


_SECTIONS = {"queue": _queue_line, "pressure": _pressure_line, "journal": _journal_line}
_SHOWN = {"status", "state", "pid", "uptime_s", "started_at", "socket", "models", "mlock", "cgroup",
          *_SECTIONS}


def _serial_line(port: dict[str, Any]) -> str:
    state = "up" if port.get("up") else "DOWN (reopening)"
    return (f"{port.get('url', '?')} {state}; link lost {_scalar(port.get('link_lost'))}, "
            f"reopened {_scalar(port.get('reopens'))}, failed opens "
            f"{_scalar(port.get('open_failures'))}")


def render_health(health: dict[str, Any], socket_path: str, http_status: int) -> str:
    """Human-readable /health: a headline, one line per section, a table of the models.

    The per-model mlock report is shown in the table (the top-level `mlock` copy is not
    repeated); sections this function does not know are printed as key=value lines, so a
    field the daemon adds is never hidden. `--json` gives the whole document.
    """
    state = health.get("status") or health.get("state") or ("ok" if http_status == 200 else "?")
    facts = []
    if health.get("pid") is not None:
        facts.append(f"pid {health['pid']}")
    if health.get("uptime_s") is not None:
        up = f"up {_duration(health['uptime_s'])}"
        if isinstance(health.get("started_at"), str):
            up += f" since {health['started_at']}"
        facts.append(up)
    facts += [f"HTTP {http_status}", f"socket {socket_path}"]
    lines = [f"edge-agent: {state} ({', '.join(facts)})"]
    for key, render in _SECTIONS.items():
        if isinstance(health.get(key), dict):
            lines.append(f"{key + ':':<10} {render(health[key])}")
    if isinstance(health.get("cgroup"), dict):
        first, *rest = _cgroup_lines(health["cgroup"])
        lines.append(f"{'cgroup:':<10} {first}")
        lines += [f"{'':<10} {line}" for line in rest]
    ports = health.get("serial")
    if isinstance(ports, list):
        for i, port in enumerate(p for p in ports if isinstance(p, dict)):
            lines.append(f"{'serial:' if i == 0 else '':<10} {_serial_line(port)}")
    for key, value in health.items():
        if key not in _SHOWN and not (key == "serial" and isinstance(value, list)):
            lines.append(f"{key + ':':<10} "
                         f"{_inline(value) if isinstance(value, dict) else _scalar(value)}")
    lines += _model_rows(health.get("models"))
    return "\n".join(lines)


def run_status(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    client = client_for(args)
    try:
        code, health = client.health_status()
    except DaemonUnavailable as exc:
        if not args.json:
            raise
        print(json.dumps({"available": False, "socket": client.socket_path,
                          "error": {"code": exc.code, "message": exc.message}}), file=out)
        return 1
    if args.json:
        print(json.dumps({"available": True, "socket": client.socket_path,
                          "http_status": code, "health": health}), file=out)
    else:
        print(render_health(health, client.socket_path, code), file=out)
    return 0 if code == 200 else 1


# ----- models ----------------------------------------------------------------------------------


def run_models(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    models = client_for(args).models()
    if args.json:
        print(json.dumps(models), file=out)
        return 0
    if not models:
        print("edge-agent: the daemon has no models configured", file=sys.stderr)
        return 0
    table = [("NAME", "STATE", "CONTEXT", "BATCH")]
    for m in models:
        table.append((str(m.get("id") or m.get("name") or "?"), _scalar(m.get("state")),
                      _scalar(m.get("context")), _scalar(m.get("max_batch"))))
    print("\n".join(_table(table)), file=out)
    return 0


# ----- chat ------------------------------------------------------------------------------------


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None,
             out: TextIO | None = None) -> int:
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    client = client_for(args)
    params: dict[str, Any] = {"max_tokens": args.max_tokens}
    for key in ("model", "temperature", "seed"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    interactive = stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(system)
            print("edge-agent: conversation reset", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        pieces: list[str] = []
        stream = client.stream_completion(messages=history, **params)
        try:
            for piece in stream:
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\nedge-agent: reply interrupted", file=sys.stderr)
        finally:
            stream.close()  # disconnects: the daemon cancels an unfinished reply
        out.write("\n")
        out.flush()
        history.append({"role": "assistant", "content": "".join(pieces)})
    return 0
