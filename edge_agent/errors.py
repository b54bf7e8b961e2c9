"""One exception root for edge_agent; `cli.main` maps these to exit codes.

Every message says what was tried, on what, what came back, and a `Hint:` with what to do.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "UPLOADED_ELF",
    "EdgeAgentError",
    "ConfigError",
    "UsageError",
    "ModelFileError",
    "MemoryLockError",
    "ServiceError",
    "ShuttingDown",
    "AdmissionRefused",
    "ModelNotFound",
    "ModelFailed",
    "InvalidRequest",
    "ContextExceeded",
    "RequestQueueFull",
    "JournalFailed",
    "JournalNotWritable",
    "SessionBusy",
    "SessionModelMismatch",
    "SessionNotContinuable",
    "SessionNotFound",
    "ModelNotEmbedding",
    "EmbeddingFailed",
    "PortNotOwned",
    "FlashBusy",
    "FlashJobNotFound",
    "BoardProfileError",
    "UploadFailed",
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


# -- the daemon's answers ------------------------------------------------------------------------
# Raised inside the daemon with what a caller needs as attributes, never with a transport's
# status. Each edge maps them in one place: protocol/api.py `api_error` to an HTTP status and
# OpenAI error body, daemon/uart_backend.py `backend_error` to a UART error code.


class ServiceError(EdgeAgentError):
    """The daemon refuses or cannot do what a client asked (the message says why and what to
    do); `retry_after_s` is set when trying again later can work."""

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class ShuttingDown(ServiceError):
    """The daemon is stopping; the service manager brings it back."""

    @classmethod
    def new_request(cls) -> ShuttingDown:
        """The refusal of a new generation or embedding request while the daemon stops."""
        return cls("the daemon is shutting down. Hint: retry when it is back (systemd "
                   "restarts it).", retry_after_s=5)


class AdmissionRefused(ServiceError):
    """New requests are not admitted now (memory pressure stage `stage`)."""

    def __init__(self, message: str, *, retry_after_s: int, stage: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.stage = stage


class ModelNotFound(ServiceError):
    """No model of that name is registered."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name

    @classmethod
    def in_request(cls, name: str, registered: Iterable[str]) -> ModelNotFound:
        """A request's `model` field names none of the `registered` models."""
        return cls(f"field 'model': no model named {name!r} (registered: "
                   f"{', '.join(sorted(registered))}). Hint: GET /v1/models lists them; add a "
                   "[models.NAME] table.", name=name)


class ModelFailed(ServiceError):
    """The model `name` cannot be used (its file gives no tokenizer, or its load failed)."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


class InvalidRequest(ServiceError):
    """A request the daemon cannot run as sent, though it parsed (a token id outside the
    model's vocabulary, a prompt of no tokens, a session on a plain prompt); the message starts
    with "field 'x': "."""


class ContextExceeded(InvalidRequest):
    """The prompt (with its session's history), or an embedding input, does not fit the
    model's context."""


class RequestQueueFull(ServiceError):
    """The scheduler's queue holds `queue_max` requests; `retry_after_s` is its estimate of
    when one has left."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class JournalFailed(ServiceError):
    """A new request could not be journaled (not a storage fault: the journal stays writable)."""


class JournalNotWritable(ServiceError):
    """The journal cannot be written (full or faulty storage): no request is accepted until a
    write succeeds again; `retry_after_s` is the next write attempt."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class SessionBusy(ServiceError):
    """Session `session` has request `request_id` still open: one turn at a time, so its
    history only grows by whole finished turns."""

    def __init__(self, message: str, *, session: str, request_id: str) -> None:
        super().__init__(message)
        self.session = session
        self.request_id = request_id


class SessionModelMismatch(ServiceError):
    """Session `session` is a conversation with model `session_model`; the request is for
    `model`."""

    def __init__(self, message: str, *, session: str, session_model: str, model: str) -> None:
        super().__init__(message)
        self.session = session
        self.session_model = session_model
        self.model = model


class SessionNotContinuable(InvalidRequest):
    """The model's chat template does not render a later turn as an extension of the
    conversation, so a session's history cannot be continued token for token."""


class SessionNotFound(ServiceError):
    """No session `session` (never used, already reset, or forgotten)."""

    def __init__(self, message: str, *, session: str) -> None:
        super().__init__(message)
        self.session = session


class ModelNotEmbedding(InvalidRequest):
    """The model `name` computes no embeddings (its engine or its pooling type); the message
    starts with "field 'model': "."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


class EmbeddingFailed(ServiceError):
    """The model `name` could not compute the embeddings asked of it (its runner failed)."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


# what a flash job's error says for the ELF the daemon flashed: its own copy's path in the state
# directory means nothing to the client, which puts back the file name it sent
UPLOADED_ELF = "the uploaded ELF"


class PortNotOwned(ServiceError):
    """A flash job for a port the daemon does not own (`same_board_as`: the owned port naming
    the same board with other options, if any)."""

    def __init__(self, message: str, *, port: str, same_board_as: str | None = None) -> None:
        super().__init__(message)
        self.port = port
        self.same_board_as = same_board_as


class FlashBusy(ServiceError):
    """The board behind `port` is being flashed by job `job_id`."""

    def __init__(self, message: str, *, port: str, job_id: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.port = port
        self.job_id = job_id


class FlashJobNotFound(ServiceError):
    """No flash job with that id (unknown, or forgotten after it finished)."""

    def __init__(self, message: str, *, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class BoardProfileError(ServiceError):
    """The board profile a request named cannot be loaded; the message starts with
    "field 'board': "."""

    def __init__(self, message: str, *, board: str) -> None:
        super().__init__(message)
        self.board = board


class UploadFailed(ServiceError):
    """An upload could not be stored on the daemon's side (no space, no permission)."""
