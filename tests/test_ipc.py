"""The runner protocol's typed messages (daemon/ipc.py): every message survives encode ->
JSON frame -> decode unchanged, and a malformed frame is a ValueError naming the op and the
field, never a half-built message; a real runner answers a malformed request with an
ErrorReply and keeps serving, skips any hurry frame unanswered, and exits 2 on a frame that is
no JSON object (it may have been a hurry: no reply can be safely given)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edge_agent.daemon import ipc
from edge_agent.daemon.ipc import (
    AddSeq,
    Embed,
    Embedded,
    ErrorReply,
    Failed,
    Hurry,
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
    decode,
    encode,
    encode_frame,
    recv_frame,
    send_frame,
)

MESSAGES: list[Any] = [
    Step(release=("a",), add=(AddSeq(id="b", prompt=(1, 2, 3),
                                     params={"temperature": 0.5, "stop": ["x"]},
                                     generated=(4,)),), step=("c", "d")),
    Step(),
    Step(step=("c", "d"), steps=4, limits={"c": 2}),
    Embed(inputs=((1, 2), (3,))),
    Ping(), Shutdown(), Hurry(),
    Status(state="loading", pid=12), Status(state="warming"),
    Progress(stage="prepare", done=3, total=9),
    Failed(error="no such file"),
    Ready(pid=1, load_s=0.5, warm_s=0.1, lock={"locked_bytes": 7}, stop_ids=(2, 0),
          context=256, free_blocks=None, engine={"name": "llamacpp"}, batch_invariant=True),
    StepResult(tokens={"a": 5}, errors={"b": "context full"}, free_blocks=3, step_s=0.01,
               logprobs={"a": (-0.25, ((5, -0.25), (7, -1.5)))}),
    StepResult(tokens={"a": 5, "c": 9}, errors={}, free_blocks=None, step_s=0.03,
               then={"a": (6, 7)}, steps=3),
    Embedded(count=1, dim=2, vectors=b"\x00\x00\x80?\x00\x00\x00@", embed_s=0.2),
    Embedded(error="this model computes no embeddings"),
    Pong(free_blocks=4),
    ErrorReply(error="unknown op"),
    Snapshot(tokens=(1, 2, 3)),
    SnapshotData(data=b"EAKV1\n\x00", tokens=512, identity="llama 135M|ctx=2048"),
    SnapshotData(),
    Restore(tokens=(1, 2), data=b"\x01\x02"),
    Restored(ok=True),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_through_a_json_frame(msg: Any) -> None:
    wire = json.loads(encode_frame(encode(msg))[4:])
    assert decode(wire) == msg


@pytest.mark.parametrize(("obj", "words"), [
    ({"op": "teleport"}, "unknown op 'teleport'"),
    ({}, "unknown op None"),
    ({"op": "pong"}, "field 'free_blocks' is missing"),
    ({"op": "pong", "free_blocks": 1, "extra": 2}, "unknown field 'extra'"),
    ({"op": "pong", "free_blocks": "1"}, "pong.free_blocks"),
    ({"op": "step", "add": [{"id": "a", "prompt": [1, "2"], "params": {}}]}, "add[0].prompt[1]"),
    ({"op": "step", "add": [{"id": "a", "params": {}}]}, "field 'prompt' is missing"),
    ({"op": "result", "tokens": {"a": 1.5}, "errors": {}, "free_blocks": 1, "step_s": 0},
     "result.tokens.a"),
    ({"op": "result", "tokens": {}, "errors": {}, "free_blocks": 1, "step_s": 0,
      "logprobs": {"a": [0.1]}}, "result.logprobs.a"),
    ({"op": "embedded", "vectors": "not base64!"}, ""),
    ({"op": "status", "state": True}, "status.state"),
])
def test_malformed_frames_name_what_is_wrong(obj: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as info:
        decode(obj)
    assert words in str(info.value)


def test_every_op_has_a_message_and_back() -> None:
    ops = {ipc.encode(m)["op"] for m in MESSAGES if not isinstance(m, AddSeq)}
    assert ops == set(ipc._OPS)


def _runner(model_path: Path, state_dir: Path, **popen: Any
            ) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """A real llama.cpp runner of the default model on a socketpair, once it is ready."""
    pytest.importorskip("llama_cpp")
    parent, child = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_agent.daemon.runner", "--fd", str(child.fileno()),
         "--name", "smollm2", "--model", str(model_path), "--state-dir", str(state_dir),
         "--engine", "llamacpp", "--mlock", "off", "--context", "64", "--max-batch", "2",
         "--threads", "1"],
        pass_fds=(child.fileno(),), **popen)
    child.close()
    try:
        while True:  # status, progress ... ready
            first = decode(recv_frame(parent))
            if not isinstance(first, (Status, Progress)):
                break
        assert isinstance(first, Ready), first
    except BaseException:
        parent.close()
        proc.kill()
        proc.wait()
        raise
    return parent, proc


def test_a_runner_answers_a_malformed_request_and_keeps_serving(model_path: Path,
                                                               tmp_path: Path) -> None:
    parent, proc = _runner(model_path, tmp_path)
    try:
        send_frame(parent, {"op": "step", "add": "nonsense"})
        reply = decode(recv_frame(parent))
        assert isinstance(reply, ErrorReply) and "step.add" in reply.error
        send_frame(parent, encode(Ping()))
        assert isinstance(decode(recv_frame(parent)), Pong)
        # hurry frames have no reply, well formed or not: one answered here would be taken for
        # the reply to the next request
        for hurry in ({"op": "hurry"}, {"op": "hurry", "steps": 3}, {"op": "hurry", "x": [1]}):
            send_frame(parent, hurry)
        send_frame(parent, encode(Ping()))
        assert isinstance(decode(recv_frame(parent)), Pong)
        send_frame(parent, encode(Step(add=(AddSeq(id="x", prompt=(1, 2, 3),
                                                   params={"max_tokens": 2}),))))
        result = decode(recv_frame(parent))
        assert isinstance(result, StepResult) and set(result.tokens) == {"x"}
        send_frame(parent, encode(Shutdown()))
        assert proc.wait(timeout=60) == 0
    finally:
        parent.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("when", ["between messages", "mid-message"])
def test_a_runner_exits_on_a_frame_that_is_no_json_object(model_path: Path, tmp_path: Path,
                                                          when: str) -> None:
    """Such a frame may have been a hurry, which has no reply: answering it could shift every
    later reply by one, so the runner answers nothing, says why and exits 2 (the daemon
    restarts it). Mid-message, the message ends at its next step and its reply comes first."""
    errors = tmp_path / "stderr"
    with errors.open("wb") as fh:
        parent, proc = _runner(model_path, tmp_path, stderr=fh)
    try:
        if when == "mid-message":
            send_frame(parent, encode(Step(add=(AddSeq(id="x", prompt=(1, 2, 3),
                                                       params={"max_tokens": 200}),))))
            assert isinstance(decode(recv_frame(parent)), StepResult)
            send_frame(parent, encode(Step(step=("x",), steps=150)))
        parent.sendall(ipc._LEN.pack(5) + b"[1,2]")
        if when == "mid-message":
            result = decode(recv_frame(parent))
            assert isinstance(result, StepResult) and 1 <= result.steps < 150, result
        assert proc.wait(timeout=60) == 2
        err = errors.read_text()
        assert "unreadable (frame holds a JSON list, expected an object)" in err, err
        assert "restarts this runner" in err
    finally:
        parent.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
