"""A power cut of the arm64 guest while the daemon generates, and the warm start that follows.

    cut = run_journal_cut(image, tiny_gguf, "writeback", delay=2.0)
    assert cut.lost_acked == [] and cut.changed == [] and cut.unfinished == []

Boot 1 (disk served by nbdkit in `mode`): `edge-agent serve` with its state directory on the
disk and no default deadline (a request whose deadline passes while the board is down is
expired on the warm start, by design; that is not what this measures); a driver submits
requests one after another (POST /v1/requests, seeded sampling) and prints `ACK <id>` when the
daemon has answered with the id, which it does only after the request is journaled (journal.ack
= "durable"). The host waits for the first ACK, sleeps `delay`, reads the output (only what it
saw before the cut counts as acknowledged), kills nbdkit, then QEMU. Boot 2 (same image, no
cache in between): the driver opens the journal with plain sqlite3 *before* the daemon, reports
`PRAGMA integrity_check` and every request with its journaled tokens, starts the daemon, waits
for every request to finish, stops it (SIGTERM) and reports the journal again. The host
compares: every acknowledged request is in the journal and done; the tokens journaled before
the cut are a prefix of the final tokens (no journaled token changed); integrity_check said
"ok".

Invariants: the acknowledged set is read from the guest's output before the cut; boot 2 reads
the journal before any edge-agent code touches it; every wait in the guest is bounded.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .build_arm64_guest import GuestImage
from .disks import make_ext4
from .guest import Arm64Guest
from .nbd import NbdDisk, power_cut

__all__ = ["JournalCut", "make_state_disk", "run_journal_cut"]

MAX_TOKENS = 40
SERVE = """\
export EDGE_AGENT_MODELS__SMOLLM2__PATH=/mnt/disk/model.gguf
export EDGE_AGENT_MODELS__SMOLLM2__PRELOAD=true
export EDGE_AGENT_MODELS__SMOLLM2__CONTEXT=256
export EDGE_AGENT_MODELS__SMOLLM2__MAX_BATCH=4
export EDGE_AGENT_CGROUP__ENABLED=false
export EDGE_AGENT_SCHEDULER__DEFAULT_TIMEOUT_MS=none
python3 -m edge_agent --state-dir /mnt/disk/state serve --socket /run/ea.sock \
    2>>/tmp/serve.log &
echo "$!" > /tmp/serve.pid
"""

COMMON = r"""
import json, os, signal, sqlite3, sys, time
sys.path.insert(0, "/opt/edge-agent")
from edge_agent.client import DaemonClient

def emit(step, **kw):
    print(json.dumps({"step": step, **kw}), flush=True)

def wait_ready(c, limit=300):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            if c.health_status()[0] == 200:
                return round(time.monotonic() - t0, 2)
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit("daemon not ready in %d s: %s" % (limit, open("/tmp/serve.log").read()))
"""

SUBMIT = COMMON + r"""
c = DaemonClient("/run/ea.sock", timeout=60)
emit("ready", seconds=wait_ready(c))
for i in range(200):
    try:
        rid = c.submit("Story %d: once upon a time" % i, max_tokens=MAX_TOKENS,
                       temperature=0.8, seed=1000 + i)
    except Exception as exc:  # e.g. queue full: not acknowledged, not counted
        print("REFUSED", i, str(exc)[:200], flush=True)
        time.sleep(1.0)
        continue
    print("ACK", rid, flush=True)
    time.sleep(0.15)
time.sleep(600)
""".replace("MAX_TOKENS", str(MAX_TOKENS))

RESUME = COMMON + r"""
DB = "/mnt/disk/state/journal.sqlite3"

def dump():
    if not os.path.exists(DB):
        return {"exists": False}
    db = sqlite3.connect(DB)
    out = {"exists": True, "integrity": db.execute("PRAGMA integrity_check").fetchall()}
    out["requests"] = {rid: {"state": st, "tokens": []} for rid, st in
                       db.execute("SELECT id, state FROM requests")}
    for rid, idx, tok in db.execute(
            "SELECT request_id, idx, token_id FROM tokens ORDER BY request_id, idx"):
        out["requests"][rid]["tokens"].append([idx, tok])
    db.close()
    return out

before = dump()
emit("before", **before)
os.system(open("/ea/serve.sh").read())
c = DaemonClient("/run/ea.sock", timeout=60)
emit("ready", seconds=wait_ready(c))
t0 = time.monotonic()
pending = set(before.get("requests", {}))
while pending and time.monotonic() - t0 < 400:
    for rid in sorted(pending):
        try:
            if c.get_request(rid)["state"] in ("done", "failed", "cancelled", "expired"):
                pending.discard(rid)
        except Exception as exc:
            emit("get-error", id=rid, error=str(exc)[:300])
            pending.discard(rid)
    time.sleep(0.5)
emit("finished", seconds=round(time.monotonic() - t0, 2), pending=sorted(pending))
pid = int(open("/tmp/serve.pid").read())
os.kill(pid, signal.SIGTERM)
for _ in range(600):
    if not os.path.exists("/proc/%d" % pid) or " Z " in open("/proc/%d/stat" % pid).read():
        break
    time.sleep(0.1)
emit("after", **dump())
emit("log", text=open("/tmp/serve.log", errors="replace").read()[-3000:])
"""


@dataclass
class JournalCut:
    mode: str
    delay: float
    acked: list[str]                     # request ids the host saw acknowledged before the cut
    before: dict[str, Any]               # the journal as boot 2 found it (before the daemon)
    after: dict[str, Any]                # the journal once the daemon finished and stopped
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def integrity_ok(self) -> bool:
        return self.before.get("integrity") == [["ok"]]

    @property
    def lost_acked(self) -> list[str]:
        """Acknowledged requests absent from the journal after the cut."""
        have = self.before.get("requests", {})
        return [rid for rid in self.acked if rid not in have]

    @property
    def unfinished(self) -> list[str]:
        """Acknowledged requests present after the cut that did not complete after the reboot."""
        done = self.after.get("requests", {})
        return [rid for rid in self.acked if rid in self.before.get("requests", {})
                and done.get(rid, {}).get("state") != "done"]

    @property
    def unfinished_states(self) -> dict[str, str | None]:
        """State after the reboot of each unfinished acknowledged request (for diagnosis)."""
        done = self.after.get("requests", {})
        return {rid: done.get(rid, {}).get("state") for rid in self.unfinished}

    @property
    def changed(self) -> list[str]:
        """Requests whose tokens journaled before the cut are not a prefix of the final ones."""
        out = []
        for rid, req in self.before.get("requests", {}).items():
            final = self.after.get("requests", {}).get(rid, {}).get("tokens", [])
            if final[: len(req["tokens"])] != req["tokens"]:
                out.append(rid)
        return out

    @property
    def journaled_tokens(self) -> int:
        return sum(len(r["tokens"]) for r in self.before.get("requests", {}).values())


def make_state_disk(folder: Path, model: Path, size_mb: int = 96) -> Path:
    """A fresh ext4 image with the model at /model.gguf and an empty /state."""
    content = folder / "content"
    (content / "state").mkdir(parents=True)
    shutil.copyfile(model, content / "model.gguf")
    return make_ext4(folder / "disk.img", size_mb, content)


def _facts(output: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for line in output.splitlines():
        if line.startswith("{"):
            fact = json.loads(line)
            out[fact.pop("step")] = fact
    return out


def run_journal_cut(image: GuestImage, model: Path, mode: str, delay: float, *,
                    timeout: float = 300.0) -> JournalCut:
    """Boot, generate, cut `delay` s after the first ACK; boot again and finish; compare."""
    with tempfile.TemporaryDirectory(prefix="ea-jcut-") as tmp:
        img = make_state_disk(Path(tmp), model)
        files = {"/ea/submit.py": SUBMIT.encode(), "/ea/resume.py": RESUME.encode(),
                 "/ea/serve.sh": SERVE.encode()}
        t0 = time.monotonic()
        with NbdDisk(img, mode) as disk, Arm64Guest(
                "sh /ea/serve.sh; python3 /ea/submit.py", disks=[disk.qemu_file], image=image,
                files=files, memory_mb=1024) as guest:
            guest.wait_output(r"ACK req-", timeout=timeout)
            time.sleep(delay)
            seen = guest.output  # only this counts as acknowledged
            power_cut(guest, disk)
        first = time.monotonic() - t0
        acked = re.findall(r"^ACK (\S+)$", seen, re.M)
        t1 = time.monotonic()
        with Arm64Guest("python3 /ea/resume.py", disks=[img], image=image, files=files,
                        memory_mb=1024) as guest:
            r = guest.wait(timeout=timeout)
        facts = _facts(r.output)
        facts.update(boot1_s=round(first, 1), boot2_s=round(time.monotonic() - t1, 1),
                     rc=r.rc, output_tail=r.output[-3000:])
        if "before" not in facts or "after" not in facts:
            from .errors import HarnessError

            raise HarnessError(f"journal cut ({mode}, {delay:.2f} s): the second boot did not "
                               f"report the journal (rc {r.rc}); output tail: "
                               f"{r.output[-2500:]!r}. Hint: run with EDGE_AGENT_QEMU_KEEP=1 "
                               "and read the work folder.")
        return JournalCut(mode, delay, acked, facts["before"], facts["after"], facts)
