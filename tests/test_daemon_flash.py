"""Flash handoff: `edge-agent flash` posts the job to a running daemon that owns the port.

A daemon with no preloaded model (ready at once) owns a `stm32sim://` port through `flash.ports`;
the simulator keeps its flash in a file, so the test can read back what the daemon wrote.
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import firmware
import pytest
from daemon_proc import REPO, Daemon, launch, serve_argv

pytestmark = [pytest.mark.timeout(240)]


def sim_port(root: Path, board: str) -> str:
    """A simulated F405 whose flash is the file ROOT/BOARD.bin."""
    return f"stm32sim://?chip=f405&state={root / f'{board}.bin'}"


class FlashDaemon(Daemon):
    """The daemon owning `owned` (flash in ROOT/owned.bin); `other` is a board it does not
    own."""

    @property
    def owned(self) -> str:
        return sim_port(self.root, "owned")

    @property
    def other(self) -> str:
        return sim_port(self.root, "other")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
        env["EDGE_AGENT_STATE_DIR"] = str(self.root / "cli-state")
        return subprocess.run([sys.executable, "-m", "edge_agent", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    return firmware.builder(tmp_path_factory)


@pytest.fixture(scope="module")
def daemon() -> Iterator[FlashDaemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-fl-", dir="/tmp"))
    owned = sim_port(root, "owned")
    (root / "config.toml").write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        f'[flash]\nports = "{owned}"\n'
    )
    with launch(FlashDaemon, root, serve_argv(root / "config.toml"), ready_timeout=60,
                grace=30) as d:
        yield d


def test_ports_the_daemon_owns(daemon: FlashDaemon) -> None:
    status, info = daemon.json("GET", "/v1/flash/ports")
    assert status == 200 and info["ports"] == [daemon.owned]
    # identity ignores the simulator's fault knobs: same board file, same port
    status, info = daemon.json("GET", "/v1/flash/ports?port=" + _q(daemon.owned + "&nack=0x31"))
    assert info["owned"] is True
    status, info = daemon.json("GET", "/v1/flash/ports?port=" + _q(daemon.other))
    assert info["owned"] is False


def test_cli_hands_the_job_to_the_daemon_which_journals_it(
        daemon: FlashDaemon, fw: firmware.FirmwareBuilder) -> None:
    elf = fw.elf("good")
    r = daemon.cli("flash", str(elf), "--board", "stm32f405", "--port", daemon.owned,
                   "--socket", str(daemon.sock), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True and out["daemon_job"].startswith("flash-")
    assert out["elf"] == str(elf) and out["went"] is True
    assert out["bytes_verified"] >= out["size"] > 0
    assert "handed to it" in r.stderr
    status, job = daemon.json("GET", f"/v1/flash/{out['daemon_job']}")
    assert status == 200 and job["state"] == "done"
    assert job["progress"]["done"] == job["progress"]["total"] > 0
    # the simulator's flash (its state file) holds exactly the objcopy image
    image = fw.objcopy_bin("good").read_bytes()
    assert (daemon.root / "owned.bin").read_bytes()[:len(image)] == image
    # the daemon journaled the job, every sector verified
    db = sqlite3.connect(f"file:{daemon.root / 'state' / 'journal.sqlite3'}?mode=ro", uri=True)
    try:
        jid = job["journal_id"]
        assert db.execute("SELECT state, board FROM flash_jobs WHERE id = ?",
                          (jid,)).fetchone() == ("done", "stm32f405")
        states = {s for (s,) in db.execute("SELECT state FROM flash_sectors WHERE job_id = ?",
                                           (jid,))}
        assert states == {"verified"}
    finally:
        db.close()
    # a second run through the daemon finds every sector equal: nothing erased
    r = daemon.cli("flash", str(elf), "--board", "stm32f405", "--port", daemon.owned,
                   "--socket", str(daemon.sock))
    assert r.returncode == 0, r.stderr
    assert "already matched" in r.stdout and "erased" not in r.stdout


def test_port_not_owned_is_flashed_directly(daemon: FlashDaemon,
                                            fw: firmware.FirmwareBuilder) -> None:
    r = daemon.cli("flash", str(fw.elf("good")), "--board", "stm32f405", "--port",
                   daemon.other, "--socket", str(daemon.sock), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "daemon_job" not in out and out["bytes_verified"] > 0
    # --local forces the direct path even for an owned port
    r = daemon.cli("flash", str(fw.elf("good")), "--board", "stm32f405", "--port",
                   daemon.owned, "--socket", str(daemon.sock), "--json", "--local")
    assert r.returncode == 0, r.stderr
    assert "daemon_job" not in json.loads(r.stdout)


def test_failed_job_in_the_daemon_is_exit_1_with_its_reason(
        daemon: FlashDaemon, fw: firmware.FirmwareBuilder) -> None:
    # the same board (owned) with readout protection on: Read Memory is NACKed, the job fails
    port = daemon.owned + "&rdp=1"
    r = daemon.cli("flash", str(fw.elf("good")), "--board", "stm32f405", "--port", port,
                   "--socket", str(daemon.sock))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "handed to it" in r.stderr and "failed in the daemon" in r.stderr, r.stderr
    assert "NACK" in r.stderr and "Hint:" in r.stderr


def test_bad_flash_requests(daemon: FlashDaemon, fw: firmware.FirmwareBuilder) -> None:
    elf64 = base64.b64encode(fw.elf("good").read_bytes()).decode()
    good = {"elf_base64": elf64, "board": "stm32f405", "port": daemon.owned}
    cases = [
        ({**good, "port": daemon.other}, 409, "port_not_owned", "flash.ports"),
        ({**good, "colour": 1}, 400, "invalid_request", "'colour'"),
        ({**good, "elf_base64": "@@@"}, 400, "invalid_request", "'elf_base64'"),
        ({**good, "elf": "/x.elf"}, 400, "invalid_request", "exactly one"),
        ({k: v for k, v in good.items() if k != "board"}, 400, "invalid_request", "'board'"),
        ({**good, "board": "nope"}, 400, "invalid_request", "'board'"),
        ({**good, "go": "yes"}, 400, "invalid_request", "'go'"),
        ({**good, "baud": 3}, 400, "invalid_request", "'baud'"),
        ({"board": "stm32f405", "port": daemon.owned, "elf": "rel.elf"}, 400,
         "invalid_request", "absolute"),
    ]
    for body, status, code, text in cases:
        got, r = daemon.json("POST", "/v1/flash", body)
        assert (got, r["error"]["code"]) == (status, code), (body, r)
        assert text in r["error"]["message"] and "Hint:" in r["error"]["message"], r
    status, r = daemon.json("GET", "/v1/flash/flash-999")
    assert status == 404 and r["error"]["code"] == "flash_job_not_found"
    # an ELF the checks reject fails the job with the checker's reason
    bad = base64.b64encode(b"not an elf at all").decode()
    status, job = daemon.json("POST", "/v1/flash", {**good, "elf_base64": bad})
    assert status == 202
    end = time.monotonic() + 30
    while job["state"] not in ("done", "failed"):
        assert time.monotonic() < end
        time.sleep(0.05)
        job = daemon.json("GET", f"/v1/flash/{job['id']}")[1]
    assert job["state"] == "failed" and "ELF" in job["error"]["message"]


def _q(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")
