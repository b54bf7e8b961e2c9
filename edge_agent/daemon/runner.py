"""The runner child process: `python -m edge_agent.daemon.runner --fd N --model PATH ...`.

One runner serves one model on one engine (`runtime/engines.py`: llamacpp or numpy). It loads
the model (weights pinned in this process by the mlock policy, KV cache for max_batch x
context), runs a warm-up forward, says `ready`, then executes the steps the control plane sends
over the inherited socketpair (ipc.py framing) until EOF. It talks to the engine only through
the `EngineLike` interface.

Invariants owned here:
- The runner is stateless towards the outside: it decides nothing. Each `step` message is executed
  in order: releases first (free KV blocks), then prefill of added sequences (each returns its
  first token; an add with `generated` rebuilds the cache from the prompt and those tokens and
  returns the next one: a resumed request continues where it stopped), then `steps` batched
  decode steps of the listed sequences (one by default; a sequence leaves the batch at a stop id
  or after its `limits` tokens; its first token is in the reply's `tokens`, the others in
  `then`; a `hurry` frame, which has no reply, ends the message after the step in progress).
  A sequence that sampled a stop id is not stepped again until it is released. The
  reply's `logprobs` holds, for each sequence whose params ask, `[chosen token's logprob,
  [[id, logprob], ...the N most likely]]` of the message's first step; its `cached` says, per
  added sequence, how many of its leading tokens the engine's prompt cache held (they were not
  prefilled again).
- An `embed` message (token-id lists) is answered with one L2-normalized vector per list,
  float32 little-endian, base64 (`embedded`), or the engine's refusal in `error`; it runs in
  the engine's embedding context, between two steps, and changes no sequence.
- A `snapshot` message (a finished session turn's tokens) is answered with the KV state of
  the free slot holding a prefix of them (`snapshot_data`, empty when none or on an engine
  without snapshots); a `restore` loads such a blob into an empty free slot (`restored`).
  Both run between steps and change no running sequence.
- Exactly one reply per request message; a per-sequence failure (e.g. KV blocks exhausted) is
  reported in `errors` for that sequence and does not stop the others.
- Load failures are reported as `Failed` (ipc.py) and the process exits 1; the
  control plane also notices a silent death by EOF on the socketpair.
- EOF from the control plane (it exited) ends the runner: no orphan keeps weights pinned.
- A whole frame that is not a JSON object cannot be told apart from a hurry (which has no
  reply), so it is answered by nothing: the runner says so on stderr and exits 2 (after the
  message in progress, which it ends at its next step); the control plane restarts it and
  its requests resume by prefill. A JSON object that is no valid message gets an ErrorReply.
- `--fd N --prestarted` (daemon/prestart.py) imports the llama.cpp engine first, then reads the
  rest of its command line as one `{"argv": [...]}` frame; EOF before it: exit 0, nothing loaded;
  a frame that is no such object (not JSON, over MAX_FRAME, wrong fields): exit 1, saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_agent.daemon.ipc import (
    MAX_FRAME,
    AddSeq,
    Embed,
    Embedded,
    ErrorReply,
    Failed,
    FrameTooLarge,
    Message,
    Ping,
    Pong,
    Progress,
    Ready,
    Restore,
    Restored,
    Shutdown,
    Snapshot,
    SnapshotData,
    Status,
    Step,
    StepResult,
    TokenLogprob,
    decode,
    encode,
    recv_frame,
    send_frame,
)
from edge_agent.errors import EdgeAgentError
from edge_agent.logs import configure
from edge_agent.runtime.engines import EngineLike, load_engine

__all__ = ["main", "WARMUP_ID"]

WARMUP_ID = "__warmup__"
INVARIANCE_CACHE = "batch-invariance.json"  # the warm-up probe's verdicts, in the state dir
_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "min_p",
                  "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n",
                  "logit_bias", "logprobs")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge_agent.daemon.runner")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--mlock", default="best-effort")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="0: the cores this runner may use")
    p.add_argument("--engine", default="auto", help="auto, llamacpp or numpy")
    p.add_argument("--log-level", default="INFO", help="the control plane's edge_agent level")
    p.add_argument("--pooling", default="model", help="embeddings: model, mean, cls or last")
    p.add_argument("--decode", default="batched", help="llamacpp: batched or alone")
    p.add_argument("--checked", default="", help="the GGUF's stamp when the control plane's "
                   "header parse accepted it (not parsed again)")
    return p


def _params(d: dict[str, Any]) -> Any:
    from edge_agent.runtime.sampling import SamplingParams

    kw = {k: d[k] for k in _SAMPLING_KEYS if k in d}
    if "stop" in kw:
        kw["stop"] = tuple(kw["stop"])
    if "logit_bias" in kw:  # [[id, bias], ...] on the wire
        kw["logit_bias"] = tuple((int(i), float(b)) for i, b in kw["logit_bias"])
    return SamplingParams(**kw)


def _logprobs(engine: EngineLike, into: dict[str, TokenLogprob]) -> None:
    for sid, lp in engine.last_logprobs.items():
        into[sid] = (lp.logprob, tuple((int(i), float(v)) for i, v in lp.top))


def _start(engine: EngineLike, add: AddSeq) -> Any:
    from edge_agent.runtime.engine import NewSeq

    seq = NewSeq(add.id, list(add.prompt), _params(add.params), list(add.generated))
    grammar = add.params.get("grammar")
    if grammar is not None:  # constrained decoding: masks from the first token on
        engine.constraints.start(seq.seq_id, grammar, seq.generated)
    return seq


def _step(engine: EngineLike, msg: Step, ended: set[str] | None = None,
          hurried: Callable[[], bool] | None = None) -> StepResult:
    """Run one step message. `ended` (kept by the caller across messages): the sequences that
    sampled a stop id; they are not stepped again (the control plane, which ends a request on
    the same ids, releases them with its next message). `hurried`, asked between the decode
    steps of a message of several: True ends the message after the step just run (a Hurry
    came: work waits in the control plane)."""
    t0 = time.perf_counter()
    ended = set() if ended is None else ended
    for sid in msg.release:
        ended.discard(sid)
        try:
            engine.release(sid)
        except (KeyError, EdgeAgentError):
            pass
    new = []
    errors: dict[str, str] = {}
    for add in msg.add:
        try:
            new.append(_start(engine, add))
        except (TypeError, ValueError, EdgeAgentError) as exc:
            errors[add.id] = str(exc)
    added, failed = engine.add_many(new)  # similar-length prompts share one forward
    logprobs: dict[str, TokenLogprob] = {}
    _logprobs(engine, logprobs)
    tokens = {sid: int(tok) for sid, tok in added.items()}
    stop_ids = engine.stop_ids
    for add in msg.add:
        ended.discard(add.id)
    ended.update(sid for sid, tok in tokens.items() if tok in stop_ids)
    cached = {sid: engine.cached_tokens(sid) for sid in added}  # from the prompt cache
    errors.update((sid, str(exc)) for sid, exc in failed.items())
    for sid in failed:
        engine.constraints.release(sid)  # drops a grammar started for it
    step_ids = [s for s in msg.step if s not in errors and s not in ended]
    then: dict[str, list[int]] = {}
    steps = 0
    while step_ids:
        steps += 1
        try:
            out = engine.step(step_ids)
            if steps == 1:
                _logprobs(engine, logprobs)
        except EdgeAgentError as exc:
            for sid in step_ids:
                errors[sid] = str(exc)
            break
        going = []
        for sid, raw in out.items():
            tok = int(raw)
            n = _put(tokens, then, sid, tok)
            if tok in stop_ids:
                ended.add(sid)
            elif n < msg.limits.get(sid, msg.steps):
                going.append(sid)
        if steps >= msg.steps or (hurried is not None and hurried()):
            break
        step_ids = going
    return StepResult(tokens=tokens, errors=errors, free_blocks=engine.free_blocks,
                      step_s=time.perf_counter() - t0, logprobs=logprobs,
                      cached=cached, then={k: tuple(v) for k, v in then.items()},
                      steps=max(steps, 1))


def _put(tokens: dict[str, int], then: dict[str, list[int]], sid: str, tok: int) -> int:
    """Record `sid`'s next token of this message; how many it has now (in `tokens` + `then`)."""
    if sid not in tokens:
        tokens[sid] = tok
        return 1
    more = then.setdefault(sid, [])
    more.append(tok)
    return 1 + len(more)


def _embed(engine: EngineLike, msg: Embed) -> Embedded:
    t0 = time.perf_counter()
    try:
        vectors = engine.embed([list(ids) for ids in msg.inputs])
    except (TypeError, ValueError, EdgeAgentError) as exc:
        return Embedded(error=str(exc))
    return Embedded(count=int(vectors.shape[0]), dim=int(vectors.shape[1]),
                    vectors=vectors.astype("<f4", copy=False).tobytes(),
                    embed_s=time.perf_counter() - t0)


def _snapshot(engine: EngineLike, msg: Snapshot) -> SnapshotData:
    blob = engine.snapshot(list(msg.tokens))  # None on an engine that keeps no cells
    # base64 must fit one frame (the Restore that brings it back carries the tokens too)
    if not blob or len(blob) * 4 // 3 + (1 << 20) > MAX_FRAME:
        return SnapshotData()
    return SnapshotData(data=blob, tokens=engine.snapshot_tokens(blob),
                        identity=engine.identity())


def _restore(engine: EngineLike, msg: Restore) -> Restored:
    return Restored(ok=engine.restore(list(msg.tokens), msg.data))


def _send(sock: socket.socket, msg: Message) -> None:
    send_frame(sock, encode(msg))


PROTOCOL_ERROR = 2  # exit status: a frame that is not a JSON object came in


def _is_hurry(frame: dict[str, Any]) -> bool:
    """A hurry frame, well formed or not: it is never answered (the control plane waits for no
    reply to one; an ErrorReply would be taken for the reply to its next request)."""
    return frame.get("op") == "hurry"


class _Inbox:
    """The frames from the control plane, in order. Between the decode steps of a message,
    `hurried` takes what has arrived without blocking: a Hurry there ends the message; any
    other frame (or the end of the socket) waits its turn in `next`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.early: deque[dict[str, Any] | BaseException] = deque()

    def next(self) -> dict[str, Any]:
        """The next frame (blocking); EOFError / ConnectionError: the control plane is gone."""
        if not self.early:
            return recv_frame(self.sock)
        item = self.early.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def hurried(self) -> bool:
        hurry = False
        while not self.early or not isinstance(self.early[-1], BaseException):
            if not select.select([self.sock], [], [], 0)[0]:
                break
            try:
                frame = recv_frame(self.sock)
            except (EOFError, ConnectionError, ValueError) as exc:
                self.early.append(exc)  # raised in its turn: the message ends first
                return True
            if _is_hurry(frame):
                hurry = True
            else:
                self.early.append(frame)
        return hurry


def _answer(engine: EngineLike, msg: Message, ended: set[str],
            hurried: Callable[[], bool] | None = None) -> Message | None:
    """The reply to one request (None: stop serving)."""
    if isinstance(msg, Step):
        return _step(engine, msg, ended, hurried)
    if isinstance(msg, Embed):
        return _embed(engine, msg)
    if isinstance(msg, Snapshot):
        return _snapshot(engine, msg)
    if isinstance(msg, Restore):
        return _restore(engine, msg)
    if isinstance(msg, Ping):
        return Pong(free_blocks=engine.free_blocks)
    if isinstance(msg, Shutdown):
        return None
    return ErrorReply(error=f"runner protocol: {type(msg).__name__} is not a request")


def _serve(sock: socket.socket, args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5 or done >= total:
            last[0] = now
            _send(sock, Progress(stage="prepare", done=done, total=total))

    _send(sock, Status(state="loading", pid=os.getpid()))
    try:
        engine = load_engine(args.engine, Path(args.model), state_dir=Path(args.state_dir),
                             dtype=args.dtype, mlock=args.mlock, max_batch=args.max_batch,
                             context=args.context, threads=args.threads or None,
                             progress=progress, pooling=args.pooling, decode=args.decode,
                             checked=args.checked)
    except EdgeAgentError as exc:
        _send(sock, Failed(error=str(exc)))
        return 1
    load_s = time.monotonic() - t0
    _send(sock, Status(state="warming"))
    t1 = time.monotonic()
    try:
        engine.add(WARMUP_ID, engine.warmup_ids(), _params({"max_tokens": 2}))
        engine.step([WARMUP_ID])
        engine.release(WARMUP_ID)
        # () : the engine's own probe prompt (real text; a lone BOS hides kernel switches)
        invariant = engine.batch_invariance((), cache=Path(args.state_dir) / INVARIANCE_CACHE)
    except EdgeAgentError as exc:
        _send(sock, Failed(error=f"warm-up forward failed: {exc}"))
        return 1
    _send(sock, Ready(pid=os.getpid(), load_s=load_s, warm_s=time.monotonic() - t1,
                      lock=engine.lock_report(),
                      stop_ids=tuple(sorted(int(i) for i in engine.stop_ids)),
                      context=engine.context, free_blocks=engine.free_blocks,
                      engine=engine.describe(), batch_invariant=invariant))
    ended: set[str] = set()  # sequences that sampled a stop id, until released
    inbox = _Inbox(sock)
    while True:
        try:
            frame = inbox.next()
        except (EOFError, ConnectionError):
            return 0
        except ValueError as exc:  # its length prefix was whole; its body is no JSON object
            print(f"edge-agent runner: a frame from the control plane is unreadable ({exc}); "
                  "it may have been a hurry, which has no reply, so none is sent. Exiting: "
                  "the daemon restarts this runner and its requests resume.", file=sys.stderr)
            return PROTOCOL_ERROR
        if _is_hurry(frame):
            continue  # it came after the message it was for ended: nothing to hurry
        try:
            msg = decode(frame)
        except ValueError as exc:
            _send(sock, ErrorReply(error=str(exc)))
            continue
        reply = _answer(engine, msg, ended, inbox.hurried)
        if reply is None:
            return 0
        _send(sock, reply)


def _prestarted(argv: list[str]) -> list[str] | None:
    """`--fd N --prestarted` (daemon/prestart.py): import the llama.cpp engine now, while the
    control plane starts, then wait for the rest of the command line (an `{"argv": [...]}`
    frame). None: the socket closed first (nobody claimed this runner; nothing was loaded)."""
    first = argparse.ArgumentParser(prog="edge_agent.daemon.runner", add_help=False)
    first.add_argument("--fd", type=int, required=True)
    fd = first.parse_known_args(argv)[0].fd
    with contextlib.suppress(Exception):  # a failing import fails again, reported, in the load
        from edge_agent.runtime.llama_vocab import llama_lib
        from edge_agent.runtime.llamacpp import LlamaCppEngine  # noqa: F401

        llama_lib()
    sock = socket.socket(fileno=os.dup(fd))
    try:
        frame = recv_frame(sock)
    except (FrameTooLarge, ValueError) as exc:  # not EOF: a control plane bug, said as one
        raise SystemExit(f"edge_agent.daemon.runner: the argv frame is refused: {exc}; "
                         "expected {\"argv\": [strings]}") from None
    except (EOFError, OSError):
        return None
    finally:
        sock.close()
    rest = frame.get("argv")
    if not isinstance(rest, list) or not all(isinstance(a, str) for a in rest):
        raise SystemExit(f"edge_agent.daemon.runner: the argv frame holds {frame!r}, "
                         "expected {\"argv\": [strings]}")
    return ["--fd", str(fd), *rest]


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C in the terminal of a foreground `edge-agent serve` reaches the whole process group:
    # the control plane shuts down cleanly and ends this runner (EOF, then SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    argv = sys.argv[1:] if argv is None else argv
    if "--prestarted" in argv:
        argv = _prestarted(argv)
        if argv is None:
            return 0
    args = _parser().parse_args(argv)
    configure(logging.getLevelName(args.log_level))  # lines like the control plane's
    sock = socket.socket(fileno=args.fd)
    try:
        return _serve(sock, args)
    except BrokenPipeError:
        return 0
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
