"""Host board profiles (`kind = "host"`): Linux boards edge-agent runs on.

Invariants owned here:
- A host profile is `board_profiles/<name>.toml` with `kind = "host"`, a `description`, an
  optional free-form `[hardware]` table (facts, for people and `status`) and an `[agent]` table
  whose keys are configuration keys (checked by edge_agent.config like any other layer).
- `kind = "mcu"` files share the directory; naming one here is a ConfigError that points at
  `edge-agent flash --board`. edge_agent never imports firmware_tools for host profiles.
- Search order: $EDGE_AGENT_BOARD_PROFILE_DIR (colon-separated) if set; else
  /etc/edge-agent/board_profiles, then the `board_profiles/` directory of a source checkout.
  A name containing "/" or ending in ".toml" is a file path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from edge_agent.errors import ConfigError
from edge_agent.filekind import FileKindError, MiB, read_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["HostProfile", "load_host_profile", "list_host_profiles", "profile_dirs",
           "read_toml", "PROFILE_DIR_ENV"]

PROFILE_DIR_ENV = "EDGE_AGENT_BOARD_PROFILE_DIR"
_TOP_KEYS = ("kind", "description", "hardware", "agent")


@dataclass(frozen=True)
class HostProfile:
    name: str
    path: Path
    description: str
    hardware: Mapping[str, Any]
    agent: Mapping[str, Any]


def profile_dirs(env: Mapping[str, str] = os.environ) -> list[Path]:
    if env.get(PROFILE_DIR_ENV):
        return [Path(p) for p in env[PROFILE_DIR_ENV].split(":") if p]
    top = Path(__file__).resolve().parent.parent
    # a checkout's board_profiles/, else the copy an installed wheel carries (package data of
    # firmware_tools, beside edge_agent in site-packages), as firmware_tools.profiles finds it
    checkout = top / "board_profiles"
    installed = top / "firmware_tools" / "profiles"
    return [Path("/etc/edge-agent/board_profiles"), checkout if checkout.is_dir() else installed]


PROFILE_MAX_BYTES = MiB  # a board profile is a few KiB; a larger "file" is a wrong path


def read_toml(path: Path, what: str, *, hint: str, limit: int = MiB) -> dict[str, Any]:
    """The TOML table in `path` (a regular file of at most `limit` bytes), or a ConfigError that
    starts with "`what` `path`: " and says whether it could not be read, was not UTF-8 or was not
    TOML; `hint` ends the cannot-read message (what the file should be)."""
    try:
        raw = read_regular(path, limit)
    except FileKindError as exc:  # a directory, FIFO, device, missing, or larger than `limit`
        raise ConfigError(f"{what} {path}: cannot read it ({exc}). Hint: {hint}") from exc
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path}: not UTF-8 text ({exc.reason} at byte {exc.start}). "
            f"Hint: TOML files are UTF-8; check the path points at the {what}."
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{what} {path}: not valid TOML ({exc}). Hint: fix the syntax at that line."
        ) from exc


def _read(path: Path) -> dict[str, Any]:
    return read_toml(path, "board profile", limit=PROFILE_MAX_BYTES,
                     hint="check the path and its permissions; a profile is a TOML file of at "
                          "most 1 MiB.")


def list_host_profiles(dirs: list[Path] | None = None) -> list[str]:
    """Names of the readable `kind = "host"` profiles, sorted (first directory wins a name)."""
    names: set[str] = set()
    for directory in dirs if dirs is not None else profile_dirs():
        for path in sorted(directory.glob("*.toml")) if directory.is_dir() else []:
            try:
                if _read(path).get("kind") == "host":
                    names.add(path.stem)
            except ConfigError:
                continue
    return sorted(names)


def _find(name: str, dirs: list[Path]) -> Path:
    if name.endswith(".toml") or "/" in name:
        path = Path(name)
        if not path.exists():  # a directory, FIFO or device: _read says which
            raise ConfigError(
                f"board profile {path}: no such file. Hint: check the --board path, or give a "
                f"profile name ({', '.join(list_host_profiles(dirs)) or 'none found'})."
            )
        return path
    for directory in dirs:
        path = directory / f"{name}.toml"
        if path.is_file():
            return path
    known = ", ".join(list_host_profiles(dirs)) or "(none)"
    where = ", ".join(str(d) for d in dirs)
    raise ConfigError(
        f"board profile {name!r}: no file {name}.toml in {where}. "
        f"Hint: use one of the host profiles: {known}; or pass the path of a .toml file."
    )


def load_host_profile(
    name: str, *, env: Mapping[str, str] = os.environ, dirs: list[Path] | None = None
) -> HostProfile:
    """Load a `kind = "host"` profile by name or path; structure only (config checks [agent])."""
    search = dirs if dirs is not None else profile_dirs(env)
    path = _find(name, search)
    doc = _read(path)
    kind = doc.get("kind")
    if kind == "mcu":
        raise ConfigError(
            f"board profile {path}: kind = \"mcu\" is an MCU target for `edge-agent flash "
            f"--board {path.stem}`, not a host board edge-agent runs on. Hint: pass a host "
            f"profile to --board here ({', '.join(list_host_profiles(search)) or 'none found'})."
        )
    if kind != "host":
        raise ConfigError(
            f"board profile {path}: kind = {kind!r}, expected \"host\". "
            'Hint: host board profiles start with kind = "host".'
        )
    unknown = sorted(set(doc) - set(_TOP_KEYS))
    if unknown:
        raise ConfigError(
            f"board profile {path}: unknown top-level key(s) {', '.join(unknown)}; valid: "
            f"{', '.join(_TOP_KEYS)}. Hint: configuration keys go in the [agent] table."
        )
    description = doc.get("description", "")
    if not isinstance(description, str) or not description:
        raise ConfigError(
            f"board profile {path}: `description` must be a non-empty string, got "
            f"{description!r}. Hint: add description = \"...\" naming the board."
        )
    tables = {}
    for key in ("hardware", "agent"):
        value = doc.get(key, {})
        if not isinstance(value, dict):
            raise ConfigError(
                f"board profile {path}: `{key}` must be a table, got {type(value).__name__}. "
                f"Hint: write [{key}] and its keys below it."
            )
        tables[key] = MappingProxyType(value)
    return HostProfile(
        name=path.stem,
        path=path,
        description=description,
        hardware=tables["hardware"],
        agent=tables["agent"],
    )
