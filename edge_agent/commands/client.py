"""`edge-agent status`, `edge-agent models` and `edge-agent chat`: the daemon's CLI client.

The socket is --socket, else server.socket from the layered configuration (config file,
EDGE_AGENT_SERVER__SOCKET, ...). Data goes to stdout (JSON with --json), diagnostics to stderr.
`status` exits 0 only when the daemon is serving (1 when unreachable or not ready), so scripts
can wait on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from edge_agent.client import DaemonClient, DaemonUnavailable
from edge_agent.config import load_config

__all__ = ["register", "run_status", "run_models", "run_chat", "render_health", "client_for"]


def _common(parser: argparse.ArgumentParser, timeout: float = 30.0) -> None:
    parser.add_argument("--socket", metavar="PATH",
                        help="daemon socket (default: server.socket from the configuration)")
    parser.add_argument("--config", metavar="FILE",
                        help="configuration file (default: /etc/edge-agent/config.toml)")
    parser.add_argument("--timeout", type=float, default=timeout, metavar="S",
                        help="seconds to wait for each reply from the daemon "
                        "(default: %(default)s)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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


def client_for(args: argparse.Namespace) -> DaemonClient:
    if args.socket:
        path = Path(args.socket)
    else:
        path = load_config(args.config, env=os.environ, check_paths=False).server.socket
    return DaemonClient(path, timeout=args.timeout)


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


def render_health(health: dict[str, Any], socket_path: str, http_status: int) -> str:
    """Human-readable /health: headline, then each section on its own lines."""
    state = health.get("status") or health.get("state") or ("ok" if http_status == 200 else "?")
    lines = [f"edge-agent: {state} (HTTP {http_status}, socket {socket_path})"]
    models = health.get("models")
    for key, value in health.items():
        if key in ("status", "state", "models"):
            continue
        label = f"{key}:"
        if isinstance(value, dict):
            lines.append(f"{label:<12} {_inline(value)}")
        else:
            lines.append(f"{label:<12} {_scalar(value)}")
    if isinstance(models, dict):
        models = [{"name": name, **(v if isinstance(v, dict) else {"state": v})}
                  for name, v in models.items()]
    if isinstance(models, list) and models:
        lines.append("models:")
        for m in models:
            if not isinstance(m, dict):
                lines.append(f"  {_scalar(m)}")
                continue
            name = m.get("name") or m.get("id") or "?"
            rest = {k: v for k, v in m.items() if k not in ("name", "id", "state")}
            lines.append(f"  {name:<16} {_scalar(m.get('state')):<10} {_inline(rest)}".rstrip())
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
    for m in models:
        name = m.get("id") or m.get("name") or "?"
        rest = {k: v for k, v in m.items()
                if k not in ("id", "name", "object", "created", "owned_by")}
        print(f"{name:<20} {_inline(rest)}".rstrip(), file=out)
    if not models:
        print("edge-agent: the daemon has no models configured", file=sys.stderr)
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
