"""Client of the daemon's HTTP API over its Unix socket (stdlib http.client, no extra dependency).

Invariants owned here:
- One connection per call; a streaming call owns its connection until the iterator is exhausted
  or closed, and closing it disconnects (the daemon then cancels the request at its next step).
- Every failure is an EdgeAgentError: `DaemonUnavailable` when nothing answers on the socket,
  `DaemonError(code, message, status)` for an HTTP error reply (the server's JSON
  {"error": {"code", "message"}} when it sent one), for a timeout and for a reply that is not
  the expected JSON. `retry_after` carries a 503's Retry-After seconds. A socket path that
  can never work (too long for AF_UNIX, under a file, on /proc) is a `SocketPathError`
  (edge_agent/sockpath.py, exit 78) before any connect.
- `available()` never raises: False when the socket is absent, refuses or does not speak HTTP.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from edge_agent.errors import EdgeAgentError
from edge_agent.sockpath import SocketPathError, check_socket_path

__all__ = ["DaemonClient", "DaemonError", "DaemonUnavailable", "UnixHTTPConnection"]


class DaemonError(EdgeAgentError):
    """The daemon answered with an error (or something that is not its API)."""

    def __init__(self, code: str, message: str, status: int | None = None,
                 retry_after: float | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.retry_after = retry_after
        self.details = dict(details or {})  # what else the error says (a flash job's id)


class DaemonUnavailable(DaemonError, ConnectionError):
    """Nothing is listening on the socket (absent, refused, or no permission)."""


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over an AF_UNIX stream socket (the daemon's API socket)."""

    def __init__(self, path: str, timeout: float | None = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._unix_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class DaemonClient:
    """`DaemonClient("/run/edge-agent/edge-agent.sock").health()`."""

    def __init__(self, socket_path: str | Path, timeout: float | None = 30.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout

    # ----- transport ---------------------------------------------------------------------------

    def _open(self, method: str, path: str, body: Mapping[str, Any] | None
              ) -> tuple[UnixHTTPConnection, http.client.HTTPResponse]:
        check_socket_path(self.socket_path)  # SocketPathError (exit 78): can never connect
        conn = UnixHTTPConnection(self.socket_path, self.timeout)
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=payload, headers=headers)
            return conn, conn.getresponse()
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
            conn.close()
            raise DaemonUnavailable(
                "unavailable",
                f"{method} {path} on {self.socket_path}: {exc.strerror or exc}. Hint: start "
                "the daemon (`sudo systemctl start edge-agent` or `edge-agent serve`), or pass "
                "--socket PATH; permission denied means this user is not in the socket's group.",
            ) from exc
        except TimeoutError as exc:
            conn.close()
            raise DaemonError(
                "timeout",
                f"{method} {path} on {self.socket_path}: no answer within {self.timeout} s. "
                "Hint: the daemon may be busy loading a model; retry or raise --timeout.",
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise DaemonError(
                "protocol",
                f"{method} {path} on {self.socket_path}: {exc!r}. Hint: is this socket an "
                "edge-agent daemon? `edge-agent status` checks it.",
            ) from exc

    def _error(self, method: str, path: str, resp: http.client.HTTPResponse, raw: bytes
               ) -> DaemonError:
        code, message = f"http_{resp.status}", raw[:200].decode(errors="replace").strip()
        try:
            err = json.loads(raw)["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            pass
        retry = resp.getheader("Retry-After")
        try:
            retry_after = float(retry) if retry is not None else None
        except ValueError:
            retry_after = None
        return DaemonError(
            code, f"{method} {path}: HTTP {resp.status} {code}: {message or resp.reason}",
            resp.status, retry_after,
        )

    def _json(self, method: str, path: str, body: Mapping[str, Any] | None = None,
              ok: Sequence[int] = (200,)) -> Any:
        conn, resp = self._open(method, path, body)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonError("protocol", f"{method} {path}: reply cut short ({exc!r}). "
                              "Hint: check the daemon's log (journalctl -u edge-agent).") from exc
        finally:
            _close(conn, resp)
        if resp.status not in ok:
            raise self._error(method, path, resp, raw)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise DaemonError(
                "protocol", f"{method} {path}: HTTP {resp.status} body is not JSON "
                f"({raw[:80]!r}). Hint: is this socket an edge-agent daemon?", resp.status,
            ) from exc

    # ----- API ---------------------------------------------------------------------------------

    def available(self) -> bool:
        """True when something answers HTTP on the socket (any status)."""
        try:
            conn, resp = self._open("GET", "/health", None)
        except (DaemonError, SocketPathError):
            return False
        try:
            resp.read()
        except (OSError, http.client.HTTPException):
            return False
        finally:
            _close(conn, resp)
        return True

    def health(self) -> dict[str, Any]:
        """GET /health: 200 when serving, 503 while loading; both return the state."""
        return self.health_status()[1]

    def health_status(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of GET /health: 200 serving, 503 not (yet) serving."""
        conn, resp = self._open("GET", "/health", None)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonError("protocol", f"GET /health: reply cut short ({exc!r}). "
                              "Hint: check the daemon's log (journalctl -u edge-agent).") from exc
        finally:
            _close(conn, resp)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if resp.status not in (200, 503) or not isinstance(body, dict):
            if resp.status in (200, 503):
                raise DaemonError("protocol", f"GET /health: HTTP {resp.status} body is not a "
                                  f"JSON object ({raw[:80]!r}). Hint: is this an edge-agent "
                                  "daemon?", resp.status)
            raise self._error("GET", "/health", resp, raw)
        return resp.status, body

    def metrics(self) -> str:
        conn, resp = self._open("GET", "/metrics", None)
        try:
            raw = resp.read()
        finally:
            _close(conn, resp)
        if resp.status != 200:
            raise self._error("GET", "/metrics", resp, raw)
        return raw.decode()

    def models(self) -> list[dict[str, Any]]:
        body = self._json("GET", "/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise DaemonError("protocol", f"GET /v1/models: expected {{\"data\": [...]}}, got "
                              f"{str(body)[:80]}. Hint: is this an edge-agent daemon?")
        return data

    def complete(self, prompt: str, **params: Any) -> dict[str, Any]:
        return dict(self._json("POST", "/v1/completions", {"prompt": prompt, **params}))

    def chat(self, messages: Sequence[Mapping[str, str]], **params: Any) -> dict[str, Any]:
        body = {"messages": [dict(m) for m in messages], **params}
        return dict(self._json("POST", "/v1/chat/completions", body))

    def submit(self, prompt: str | None = None, *,
               messages: Sequence[Mapping[str, str]] | None = None, **params: Any) -> str:
        """POST /v1/requests; returns the request id at once."""
        body = dict(params)
        if messages is not None:
            body["messages"] = [dict(m) for m in messages]
        if prompt is not None:
            body["prompt"] = prompt
        reply = self._json("POST", "/v1/requests", body, ok=(200, 201, 202))
        if not isinstance(reply, dict) or not isinstance(reply.get("id"), str):
            raise DaemonError("protocol", f"POST /v1/requests: no request id in {reply!r:.80}. "
                              "Hint: is this an edge-agent daemon?")
        rid: str = reply["id"]
        return rid

    def get_request(self, request_id: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/v1/requests/{quote(request_id, safe='')}"))

    def cancel(self, request_id: str) -> dict[str, Any]:
        return dict(self._json("DELETE", f"/v1/requests/{quote(request_id, safe='')}"))

    def load_model(self, name: str) -> dict[str, Any]:
        return dict(self._json("POST", f"/v1/models/{quote(name, safe='')}/load", {}))

    def unload_model(self, name: str) -> dict[str, Any]:
        return dict(self._json("POST", f"/v1/models/{quote(name, safe='')}/unload", {}))

    def flash_ports(self, port: str | None = None) -> dict[str, Any]:
        """GET /v1/flash/ports[?port=P]: the ports the daemon owns (and whether P is one)."""
        path = "/v1/flash/ports" + ("" if port is None else f"?port={quote(port, safe='')}")
        return dict(self._json("GET", path))

    def flash_submit(self, board: str, port: str, elf_bytes: bytes,
                     **options: Any) -> dict[str, Any]:
        """POST /v1/flash (the ELF's bytes, a board profile name, an owned port exactly as
        the daemon lists it); the job at once."""
        import base64

        body: dict[str, Any] = {"board": board, "port": port, **options,
                                "elf_base64": base64.b64encode(elf_bytes).decode("ascii")}
        return dict(self._json("POST", "/v1/flash", body, ok=(200, 202)))

    def flash_job(self, job_id: str) -> dict[str, Any]:
        """GET /v1/flash/{id}: state, phase, progress, result or error of a flash job."""
        return dict(self._json("GET", f"/v1/flash/{quote(job_id, safe='')}"))

    def stream_completion(self, prompt: str | None = None, *,
                          messages: Sequence[Mapping[str, str]] | None = None,
                          **params: Any) -> Generator[str, None, None]:
        """Stream text pieces (SSE) from /v1/chat/completions (messages) or /v1/completions."""
        if (prompt is None) == (messages is None):
            raise ValueError("stream_completion: give exactly one of prompt or messages")
        path = "/v1/chat/completions" if messages is not None else "/v1/completions"
        body: dict[str, Any] = {**params, "stream": True}
        if messages is not None:
            body["messages"] = [dict(m) for m in messages]
        else:
            body["prompt"] = prompt
        for event in self._events("POST", path, body):
            for choice in event.get("choices") or ():
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if text:
                    yield str(text)

    def events(self, request_id: str, start: int = 0) -> Iterator[dict[str, Any]]:
        """GET /v1/requests/{id}/events?from=N: the request's events from token N on."""
        path = f"/v1/requests/{quote(request_id, safe='')}/events?from={int(start)}"
        yield from self._events("GET", path, None)

    def _events(self, method: str, path: str, body: Mapping[str, Any] | None
                ) -> Iterator[dict[str, Any]]:
        conn, resp = self._open(method, path, body)
        try:
            if resp.status != 200:
                raise self._error(method, path, resp, resp.read())
            data: list[str] = []
            while True:
                line = resp.readline()
                if not line:
                    return  # connection closed without [DONE]: the daemon ended the stream
                text = line.decode("utf-8").rstrip("\r\n")
                if text.startswith("data:"):
                    data.append(text[5:].removeprefix(" "))
                    continue
                if text or not data:
                    continue  # id:, event:, comments; or a blank line with nothing pending
                payload, data = "\n".join(data), []
                if payload == "[DONE]":
                    return
                event = _decode_event(method, path, payload)
                if isinstance(event.get("error"), dict):
                    err = event["error"]
                    raise DaemonError(str(err.get("code", "error")),
                                      f"{method} {path}: {err.get('message', err)}", 200)
                yield event
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonError("protocol", f"{method} {path}: stream cut short ({exc!r}). "
                              "Hint: check the daemon's log (journalctl -u edge-agent).") from exc
        finally:
            _close(conn, resp)


def _close(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
    # The response holds the socket through its file object: close both, or the fd leaks
    # until garbage collection (a ResourceWarning).
    resp.close()
    conn.close()


def _decode_event(method: str, path: str, payload: str) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError as exc:
        raise DaemonError("protocol", f"{method} {path}: server-sent event is not JSON "
                          f"({payload[:80]!r}). Hint: is this an edge-agent daemon?") from exc
    if not isinstance(event, dict):
        raise DaemonError("protocol", f"{method} {path}: server-sent event is not an object "
                          f"({payload[:80]!r}). Hint: is this an edge-agent daemon?")
    return event
