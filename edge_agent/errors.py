"""One exception root for edge_agent; `cli.main` maps these to exit codes.

Every message says what was tried, on what, what came back, and a `Hint:` with what to do.
"""

from __future__ import annotations

__all__ = [
    "EdgeAgentError",
    "ConfigError",
    "UsageError",
    "ModelFileError",
    "MemoryLockError",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "EXIT_CONFIG",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CONFIG = 78  # EX_CONFIG: systemd's RestartPreventExitStatus=78 stops a restart loop


class EdgeAgentError(Exception):
    """Root of every error edge_agent raises on purpose."""

    exit_code = EXIT_ERROR


class ConfigError(EdgeAgentError, ValueError):
    """Bad configuration: a key, value or file that cannot be used."""

    exit_code = EXIT_CONFIG


class UsageError(EdgeAgentError, ValueError):
    """Bad command-line usage that argparse could not catch."""

    exit_code = EXIT_USAGE


class ModelFileError(EdgeAgentError, ValueError):
    """A GGUF or prepared weights file that cannot be used (names the file and the fault)."""


class MemoryLockError(EdgeAgentError, OSError):
    """Weights could not be locked in memory and the policy requires it."""
