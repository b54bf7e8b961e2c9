"""Flash handoff: `edge-agent flash` posts the job to a running daemon that owns the port.

A daemon with no preloaded model (ready at once) owns three `stm32sim://` ports through
`flash.ports` (a plain board, one with readout protection on, one on a slow link); the simulator
keeps its flash in a file, so the test can read back what the daemon wrote. The request takes
the ELF's bytes, a board profile name and one of the owned port strings, nothing that names a
file on the daemon's side.
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
from typing import Any

import firmware
import pytest
from daemon_proc import REPO, Daemon, launch, serve_argv

pytestmark = [pytest.mark.timeout(240)]


def sim_port(root: Path, board: str, knobs: str = "") -> str:
    """A simulated F405 whose flash is the file ROOT/BOARD.bin (KNOBS: '&key=value...')."""
    return f"stm32sim://?chip=f405&state={root / f'{board}.bin'}{knobs}"


class FlashDaemon(Daemon):
    """The daemon owning `owned` (flash in ROOT/owned.bin), `locked` (readout protection on:
    every job fails) and `slow` (a 9600-baud link: a job lasts about a second); `other` is a
    board it does not own."""

    @property
    def owned(self) -> str:
        return sim_port(self.root, "owned")

    @property
    def locked(self) -> str:
        return sim_port(self.root, "locked", "&rdp=1")

    @property
    def slow(self) -> str:
        return sim_port(self.root, "slow", "&baud=9600")

    @property
    def other(self) -> str:
        return sim_port(self.root, "other")

    @property
    def uploads(self) -> Path:
        return self.root / "state" / "flash" / "uploads"

    def uploaded(self) -> list[Path]:
        return sorted(self.uploads.iterdir()) if self.uploads.is_dir() else []

    def wait_job(self, job: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while job["state"] not in ("done", "failed"):
            assert time.monotonic() < end, job
            time.sleep(0.05)
            job = self.json("GET", f"/v1/flash/{job['id']}")[1]
        return job

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
    ports = [sim_port(root, "owned"), sim_port(root, "locked", "&rdp=1"),
             sim_port(root, "slow", "&baud=9600")]
    (root / "config.toml").write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        'max_body_bytes = "8M"\n'
        f'[flash]\nports = "{", ".join(ports)}"\n'
    )
    with launch(FlashDaemon, root, serve_argv(root / "config.toml"), ready_timeout=60,
                grace=30) as d:
        yield d


def test_ports_the_daemon_owns(daemon: FlashDaemon) -> None:
    status, info = daemon.json("GET", "/v1/flash/ports")
    assert status == 200 and info["ports"] == [daemon.owned, daemon.locked, daemon.slow]
    status, info = daemon.json("GET", "/v1/flash/ports?port=" + _q(daemon.owned))
    assert info["owned"] is True
    # ports are compared as exact strings: the same board with a knob added is not owned
    status, info = daemon.json("GET", "/v1/flash/ports?port=" + _q(daemon.owned + "&nack=0x31"))
    assert info["owned"] is False and info["same_board_as"] == daemon.owned
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


def test_the_daemons_board_under_another_string_is_refused_not_flashed_beside_it(
        daemon: FlashDaemon, fw: firmware.FirmwareBuilder) -> None:
    # the owned board with another option: flashing it here would talk to the bootloader
    # while the daemon may; the CLI names the daemon's string and flashes nothing
    before = (daemon.root / "owned.bin").read_bytes() if (daemon.root / "owned.bin").exists() \
        else None
    port = daemon.owned + "&baud=57600"
    r = daemon.cli("flash", str(fw.elf("good")), "--board", "stm32f405", "--port", port,
                   "--socket", str(daemon.sock), "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["error"]["code"] == "port_owned_as_other_string"
    assert f"--port {port!r} names the board the daemon" in r.stderr, r.stderr
    assert f"Hint: pass --port {daemon.owned!r} exactly" in r.stderr and "--local" in r.stderr
    after = (daemon.root / "owned.bin").read_bytes() if (daemon.root / "owned.bin").exists() \
        else None
    assert after == before


def test_failed_job_in_the_daemon_is_exit_1_with_its_reason(
        daemon: FlashDaemon, fw: firmware.FirmwareBuilder) -> None:
    # an owned board with readout protection on: Read Memory is NACKed, the job fails
    r = daemon.cli("flash", str(fw.elf("good")), "--board", "stm32f405", "--port",
                   daemon.locked, "--socket", str(daemon.sock))
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
        ({k: v for k, v in good.items() if k != "elf_base64"}, 400, "invalid_request",
         "'elf_base64'"),
        ({k: v for k, v in good.items() if k != "board"}, 400, "invalid_request", "'board'"),
        ({**good, "board": "nope"}, 400, "invalid_request", "'board'"),
        ({**good, "go": "yes"}, 400, "invalid_request", "'go'"),
        ({**good, "baud": 3}, 400, "invalid_request", "'baud'"),
    ]
    for body, status, code, text in cases:
        got, r = daemon.json("POST", "/v1/flash", body)
        assert (got, r["error"]["code"]) == (status, code), (body, r)
        assert text in r["error"]["message"] and "Hint:" in r["error"]["message"], r
    status, r = daemon.json("GET", "/v1/flash/flash-999")
    assert status == 404 and r["error"]["code"] == "flash_job_not_found"
    # arrays nested 100 000 deep: the decoder's recursion limit is a 400, not a daemon bug
    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, data = daemon.call("POST", "/v1/flash", raw=deep)
    assert status == 400 and b"nested" in data and b"Hint:" in data, data
    # an ELF the checks reject is refused at once with the checker's reason, naming the ELF
    # as the one uploaded (the daemon's own copy's path would mean nothing to the client): no
    # job, nothing stored
    bad = base64.b64encode(fw.elf("no_at").read_bytes()).decode()
    status, r = daemon.json("POST", "/v1/flash", {**good, "elf_base64": bad})
    assert (status, r["error"]["code"]) == (400, "invalid_request"), r
    message = r["error"]["message"]
    assert message.startswith("field 'elf_base64': the uploaded ELF"), message
    assert "outside stm32f405 flash" in message and "Hint:" in message, message
    assert "uploads" not in message and daemon.uploaded() == []
    # through the CLI: checked before anything is sent, so the error is --local's own: the
    # file the user named, the checker's hint, and --json's error with the rule
    elf = fw.elf("no_at")
    r2 = daemon.cli("flash", str(elf), "--board", "stm32f405", "--port", daemon.owned,
                    "--socket", str(daemon.sock), "--json")
    assert r2.returncode == 1, r2.stderr
    assert f"{elf}: " in r2.stderr and "outside stm32f405 flash" in r2.stderr, r2.stderr
    assert "handed to it" not in r2.stderr and "--resume" not in r2.stderr
    doc = json.loads(r2.stdout)
    assert doc["ok"] is False and "daemon_job" not in doc["error"], doc
    assert doc["error"]["code"] == "ElfImageError" and doc["error"]["rule"], doc
    local = daemon.cli("flash", str(elf), "--board", "stm32f405", "--port", daemon.owned,
                       "--local", "--json")
    assert json.loads(local.stdout)["error"] == doc["error"], local.stdout


# -- the request names nothing on the daemon's side: bytes, a profile name, an owned port ------


def _error(daemon: FlashDaemon, body: dict[str, Any]) -> tuple[int, str, str]:
    status, r = daemon.json("POST", "/v1/flash", body)
    assert "error" in r, (body, r)
    return status, r["error"]["code"], r["error"]["message"]


def test_an_elf_path_is_refused_whatever_it_names(
        daemon: FlashDaemon, fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    secret = tmp_path / "secret.elf"
    secret.write_bytes(b"\x7fELF-SECRET-OF-THE-DAEMON-USER")
    secret.chmod(0o644)
    answers = set()
    for path in (str(secret), str(fw.elf("good")), "/nonexistent/fw.elf", "rel.elf"):
        status, code, message = _error(
            daemon, {"elf": path, "board": "stm32f405", "port": daemon.owned})
        assert (status, code) == (400, "invalid_request"), message
        assert message.startswith("field 'elf':"), message
        assert "elf_base64" in message.split("Hint:")[1], message
        assert "SECRET" not in message and "no such file" not in message, message
        answers.add(message.replace(path, "PATH"))
    # an existing file, a readable ELF, a missing file and a relative name get the same answer
    assert len(answers) == 1, answers
    assert daemon.uploaded() == []


def test_board_is_a_profile_name_never_a_path(daemon: FlashDaemon,
                                              fw: firmware.FirmwareBuilder,
                                              tmp_path: Path) -> None:
    from firmware_tools.profiles import list_profiles, profile_dir

    copy = tmp_path / "stm32f405.toml"
    copy.write_bytes((profile_dir() / "stm32f405.toml").read_bytes())
    elf64 = base64.b64encode(fw.elf("good").read_bytes()).decode()
    for board in (str(copy), str(profile_dir() / "stm32f405.toml"), "stm32f405.toml",
                  "../board_profiles/stm32f405", "board_profiles/stm32f405",
                  "..\\board_profiles\\stm32f405", "/etc/passwd", "rpi5", "nope"):
        status, code, message = _error(
            daemon, {"elf_base64": elf64, "board": board, "port": daemon.owned})
        assert (status, code) == (400, "invalid_request"), (board, message)
        assert message.startswith("field 'board':"), message
        assert ", ".join(list_profiles()) in message and "Hint:" in message, message
    assert daemon.uploaded() == []


def test_port_is_one_of_the_owned_strings_exactly(daemon: FlashDaemon,
                                                 fw: firmware.FirmwareBuilder,
                                                 tmp_path: Path) -> None:
    elf64 = base64.b64encode(fw.elf("good").read_bytes()).decode()
    timeline = tmp_path / "timeline.tsv"
    for port in (daemon.owned + f"&timeline={timeline}", daemon.owned + "&nack=0x31",
                 daemon.locked.replace("&rdp=1", ""), daemon.owned.replace("chip=f405&", "") +
                 "&chip=f405", daemon.owned + " "):
        status, code, message = _error(
            daemon, {"elf_base64": elf64, "board": "stm32f405", "port": port})
        assert (status, code) == (409, "port_not_owned"), (port, message)
        assert all(p in message for p in (daemon.owned, daemon.locked, daemon.slow)), message
        assert "Hint:" in message
    assert not timeline.exists() and daemon.uploaded() == []


def test_uploads_are_bounded_by_the_largest_flash(daemon: FlashDaemon) -> None:
    from firmware_tools.profiles import list_profiles, load_profile

    largest = max(load_profile(n).flash_size for n in list_profiles())
    status, info = daemon.json("GET", "/v1/flash/ports")
    limit = info["max_elf_bytes"]
    assert largest < limit <= largest + (1 << 20)
    too_big = b"\x7fELF" + bytes(limit - 3)
    status, code, message = _error(daemon, {"elf_base64": base64.b64encode(too_big).decode(),
                                            "board": "stm32f405", "port": daemon.owned})
    assert (status, code) == (413, "elf_too_large"), message
    assert f"{limit + 1} bytes" in message and f"limit of {limit} bytes" in message, message
    assert "largest flash" in message and "Hint:" in message, message
    assert daemon.uploaded() == []


def test_uploads_are_private_and_deleted_when_their_job_ends(
        daemon: FlashDaemon, fw: firmware.FirmwareBuilder) -> None:
    good = base64.b64encode(fw.elf("good").read_bytes()).decode()
    body = {"elf_base64": good, "board": "stm32f405", "port": daemon.slow}
    status, job = daemon.json("POST", "/v1/flash", body)
    assert status == 202, job
    # while the job runs: its upload alone, readable by the daemon's user only
    [upload] = daemon.uploaded()
    assert upload.stat().st_mode & 0o777 == 0o600
    assert daemon.uploads.stat().st_mode & 0o777 == 0o700
    assert upload.read_bytes() == fw.elf("good").read_bytes()
    # a request refused while it runs (port busy) leaves nothing behind
    status, code, _ = _error(daemon, body)
    assert (status, code) == (409, "port_busy")
    assert daemon.uploaded() == [upload]
    job = daemon.wait_job(job)
    assert job["state"] == "done", job["error"]
    assert daemon.uploaded() == []  # success
    # failure: the board refuses (readout protection) ...
    status, job = daemon.json("POST", "/v1/flash", {**body, "port": daemon.locked})
    assert status == 202 and daemon.wait_job(job)["state"] == "failed"
    assert daemon.uploaded() == []
    # ... or the checks reject the ELF: refused before anything is stored
    no_at = base64.b64encode(fw.elf("no_at").read_bytes()).decode()
    status, r = daemon.json("POST", "/v1/flash", {**body, "elf_base64": no_at,
                                                  "port": daemon.owned})
    assert status == 400, r
    assert daemon.uploaded() == []


def test_errors_never_show_the_bytes_of_the_file(daemon: FlashDaemon) -> None:
    for data in (b"SECRET-CONTENT-" * 8, b"\x7fELFSECRET-CONTENT-" * 8, b"\x7fELF"):
        body = {"elf_base64": base64.b64encode(data).decode(), "board": "stm32f405",
                "port": daemon.owned}
        status, r = daemon.json("POST", "/v1/flash", body)
        if status == 202:
            r = daemon.wait_job(r)
            assert r["state"] == "failed"
        message = r["error"]["message"]
        assert "Hint:" in message, message
        for piece in ("SECR", "ECRE", "CONTENT", "b'", 'b"'):
            assert piece not in message, message
    assert "SECR" not in daemon.log_tail()
    assert daemon.uploaded() == []


@pytest.fixture(scope="module")
def small_daemon() -> Iterator[FlashDaemon]:
    """A daemon started over uploads a killed one left behind, with a body limit (8 KiB)
    smaller than the test ELF in base64: POST /v1/flash has its own."""
    root = Path(tempfile.mkdtemp(prefix="ea-fl2-", dir="/tmp"))
    uploads = root / "state" / "flash" / "uploads"
    uploads.mkdir(parents=True)
    for name in ("flash-1-1700000000.elf", "flash-2-1700000001.elf", "leftover.tmp"):
        (uploads / name).write_bytes(b"\x7fELF left by a daemon that was killed")
    (root / "config.toml").write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        'max_body_bytes = "8K"\n'
        f'[flash]\nports = "{sim_port(root, "owned")}"\n'
    )
    with launch(FlashDaemon, root, serve_argv(root / "config.toml"), ready_timeout=60,
                grace=30) as d:
        yield d


def test_stale_uploads_are_removed_at_start(small_daemon: FlashDaemon) -> None:
    assert small_daemon.uploads.is_dir() and small_daemon.uploaded() == []


def test_a_whole_elf_is_taken_whatever_server_max_body_bytes_says(
        small_daemon: FlashDaemon, fw: firmware.FirmwareBuilder) -> None:
    from edge_agent.daemon.flashing import FLASH_JSON_BYTES, upload_limit

    d = small_daemon
    elf = fw.elf("good")
    assert len(base64.b64encode(elf.read_bytes())) > 8 * 1024
    # the route's own limit: the largest ELF base64-encoded, and the JSON around it
    status, info = d.json("GET", "/v1/flash/ports")
    limit = info["max_body_bytes"]
    assert limit == 4 * -(-upload_limit()[0] // 3) + FLASH_JSON_BYTES
    r = d.cli("flash", str(elf), "--board", "stm32f405", "--port", d.owned,
              "--socket", str(d.sock), "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "handed to it" in r.stderr and json.loads(r.stdout)["daemon_job"]
    image = fw.objcopy_bin("good").read_bytes()
    assert (d.root / "owned.bin").read_bytes()[:len(image)] == image
    # every other route keeps server.max_body_bytes, and says which key raises it
    status, _, data = d.call("POST", "/v1/completions", {"prompt": "x" * 9000})
    assert status == 413
    assert "limit of 8192 bytes" in data.decode() and "server.max_body_bytes" in data.decode()
    # and /v1/flash refuses past its own, without naming a key that would not help
    status, _, data = d.call("POST", "/v1/flash", {"elf_base64": "A" * limit})
    assert status == 413, data
    assert f"limit of {limit} bytes" in data.decode()
    assert "server.max_body_bytes" not in data.decode()


def _q(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def test_a_flash_port_pyserial_cannot_use_stops_the_start_with_78() -> None:
    # an unknown scheme in flash.ports is the configuration's fault: said at start, naming
    # it, not as a failed job on the first flash
    root = Path(tempfile.mkdtemp(prefix="ea-fl3-", dir="/tmp"))
    try:
        cfg = root / "config.toml"
        cfg.write_text(
            f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
            '[models.smollm2]\npreload = false\n'
            f'[flash]\nports = "{sim_port(root, "owned")}, bogus://x"\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
        r = subprocess.run([sys.executable, *serve_argv(cfg)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 78, r.stderr
        assert "flash.ports: 'bogus://x': pyserial cannot use it" in r.stderr
        assert "Hint:" in r.stderr and "listening on" not in r.stderr
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
