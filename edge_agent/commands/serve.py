"""`edge-agent serve`: run the daemon in the foreground (control plane + model runners).

Configuration is layered by edge_agent.config.load_config (built-in defaults < config file <
board profile < EDGE_AGENT_* environment < these flags); bad configuration exits 78 through
cli.main. `--print-config` prints the merged configuration as JSON on stdout and exits.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the daemon in the foreground (HTTP API on a Unix socket)",
        description="Run the control plane in the foreground: model runners, scheduler, "
        "HTTP/1.1 API on a Unix socket. Speaks sd_notify when NOTIFY_SOCKET is set.",
    )
    parser.add_argument("--config", metavar="FILE",
                        help="TOML configuration (default: /etc/edge-agent/config.toml if present)")
    parser.add_argument("--socket", metavar="PATH", help="Unix socket path (server.socket)")
    parser.add_argument("--state-dir", metavar="DIR", default=argparse.SUPPRESS,
                        help="state directory (same as the global --state-dir)")
    parser.add_argument("--board", metavar="NAME",
                        help="host board profile from board_profiles/ (its [agent] table)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the merged configuration as JSON and exit")
    parser.set_defaults(func=run)


def _load(args: argparse.Namespace) -> Any:
    from edge_agent.config import load_config

    overrides: dict[str, Any] = {}
    flags: dict[str, str] = {}
    if args.socket:
        overrides["server.socket"] = args.socket
        flags["server.socket"] = "--socket"
    if getattr(args, "state_dir", None):
        overrides["server.state_dir"] = args.state_dir
        flags["server.state_dir"] = "--state-dir"
    return load_config(args.config, board=args.board, env=os.environ, overrides=overrides,
                       flags=flags)


def run(args: argparse.Namespace) -> int:
    config = _load(args)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        return 0
    if not os.environ.get("LISTEN_FDS"):  # socket activation: the configured path is unused
        from edge_agent.sockpath import check_socket_path

        check_socket_path(config.server.socket, role="serve")  # before anything starts
    from edge_agent.daemon.prestart import prestart

    # a llama.cpp runner imports its engine while the daemon below is imported and set up
    prestarted = prestart(config)
    try:
        import asyncio

        from edge_agent.daemon.app import Daemon

        async def main() -> int:
            return await Daemon(config, prestarted=prestarted).serve()

        return asyncio.run(main())
    finally:
        if prestarted is not None:
            prestarted.discard()
