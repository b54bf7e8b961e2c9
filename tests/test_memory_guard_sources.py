"""Which memory.pressure files the memory guard watches, on a temporary cgroup tree whose
pressure files are real kernel files: the service's own file refused by the kernel (EACCES,
as Debian 12's root-owned file is), triggers armed on the supervisor/ and models/ groups the
daemon created, a firing counted as a pressure event, and a refused leaf polled instead."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
from cgroup_fake import FakeKernel, make_tree
from guard_host import make_guard

import edge_agent.daemon.pressure_sources as sources_mod
from edge_agent.cgroup import PressureWatcher
from edge_agent.daemon.memory_guard import MemoryGuard

OWN = "system.slice/edge-agent.service"
PSI = Path("/proc/pressure/memory")
# A kernfs file that refuses an open for writing with EACCES even to root, like the root-owned
# memory.pressure of a systemd 252 service refuses its unprivileged user.
READ_ONLY = Path("/sys/devices/system/cpu/online")
QUIET = ("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
         "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


class LinkedKernel(FakeKernel):
    """mkdir makes the group's memory.pressure a symlink to a real file chosen by the test."""

    def __init__(self, mount: Path, links: dict[str, Path]) -> None:
        super().__init__(mount)
        self.links = links

    def mkdir(self, path: Path) -> None:
        super().mkdir(path)
        target = self.links.get(self.rel(path))
        if target is not None:
            (path / "memory.pressure").unlink()
            (path / "memory.pressure").symlink_to(target)


def need_real_files() -> None:
    try:
        os.close(os.open(READ_ONLY, os.O_RDWR))
    except PermissionError:
        pass
    except OSError as exc:
        pytest.skip(f"SKIPPED LOUDLY: {READ_ONLY} is not a read-only kernfs file here ({exc})")
    else:
        pytest.skip(f"SKIPPED LOUDLY: {READ_ONLY} opened for writing: no EACCES to test with")
    try:
        PressureWatcher(PSI, b"some 300000 2000000\0").open().close()
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"SKIPPED LOUDLY: cannot arm a 2 s trigger on {PSI} here: {exc}")


def setup(tmp_path: Path, links: dict[str, Path]) -> MemoryGuard:
    t = make_tree(tmp_path / "t", own=OWN, pids=(os.getpid(),))
    service = t.mount / OWN / "memory.pressure"
    service.unlink()
    service.symlink_to(READ_ONLY)
    kernel = LinkedKernel(t.mount, {f"{OWN}/{k}": v for k, v in links.items()})
    return make_guard(tmp_path, env={}, io_factory=lambda: kernel, proc_root=str(t.proc))


def test_refused_service_file_arms_triggers_on_the_groups_we_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stderr_log: None) -> None:
    need_real_files()
    fifo = tmp_path / "models.fifo"  # stands in for models/ so the test can make it fire
    os.mkfifo(fifo)
    g = setup(tmp_path, {"supervisor": PSI, "models": fifo})

    async def go() -> tuple[dict, dict]:
        g.start(asyncio.get_running_loop())
        assert g.status.available, g.status.reason
        quiet = g.pressure_dict()
        w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(w, b"x")
            for _ in range(100):
                await asyncio.sleep(0.02)
                if g.stages.stage:
                    break
        finally:
            os.close(w)
        fired = g.pressure_dict()
        g.close()
        return quiet, fired

    quiet, fired = asyncio.run(go())
    root = tmp_path / "t" / "cg" / OWN
    assert [(s["file"], s["kind"], s["role"]) for s in quiet["sources"]] == [
        (str(root / "supervisor" / "memory.pressure"), "psi", "supervisor"),
        (str(root / "models" / "memory.pressure"), "fifo", "models")]
    assert quiet["triggers_armed"] == 2 and quiet["error"] is None
    assert quiet["source"] == str(root / "supervisor" / "memory.pressure")
    assert quiet["kind"] == "psi" and quiet["stage"] == 0
    (refused,) = quiet["refused"]
    assert refused["file"] == str(root / "memory.pressure") and refused["role"] == "service"
    assert "Permission denied (EACCES). Hint: not allowed to create a PSI trigger" in (
        refused["error"])
    # a firing on any source is one pressure event, counted on that source
    assert fired["stage"] == 1 and fired["events"] == 1
    assert [s["events"] for s in fired["sources"]] == [0, 1]
    assert fired["history"][0]["reason"] == (
        f"fifo source fired on {root / 'models' / 'memory.pressure'}")
    err = capsys.readouterr().err
    assert (f"memory pressure: no trigger on {root / 'memory.pressure'} (service): EACCES "
            "(systemd < 254 leaves it root-owned); trying the supervisor/ and models/") in err
    assert (f"memory pressure: watching {root / 'supervisor' / 'memory.pressure'} "
            "(psi, supervisor)") in err
    assert f"armed {root / 'supervisor' / 'memory.pressure'} (psi), " in err
    assert "polling" not in err


def test_metrics_name_each_watched_file_and_its_kind(tmp_path: Path) -> None:
    need_real_files()
    g = setup(tmp_path, {"supervisor": PSI, "models": PSI})

    async def go() -> str:
        g.start(asyncio.get_running_loop())
        text = g.render_metrics()
        g.close()
        return text

    text = asyncio.run(go())
    root = tmp_path / "t" / "cg" / OWN
    for leaf in ("supervisor", "models"):
        f = root / leaf / "memory.pressure"
        assert f'edge_agent_memory_pressure_source{{file="{f}",kind="psi",role="{leaf}"}} 1' \
            in text
        assert (f'edge_agent_memory_pressure_source_events_total{{file="{f}",kind="psi",'
                f'role="{leaf}"}} 0') in text
    assert "edge_agent_memory_pressure_triggers_armed 2" in text
    assert "# TYPE edge_agent_memory_pressure_source gauge" in text
    assert "psi = a kernel PSI trigger woken by POLLPRI" in text


def test_a_refused_leaf_is_polled_while_the_other_is_armed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], stderr_log: None) -> None:
    need_real_files()
    sup = tmp_path / "supervisor.pressure"  # readable PSI text whose trigger is refused
    sup.write_text(QUIET)
    fifo = tmp_path / "models.fifo"
    os.mkfifo(fifo)
    real_arm = PressureWatcher._arm

    def arm(self: PressureWatcher) -> None:  # what Linux 6.1 answers without CAP_SYS_RESOURCE
        if self.path.resolve() == sup:
            raise OSError(errno.EPERM, "Operation not permitted")
        real_arm(self)

    monkeypatch.setattr(PressureWatcher, "_arm", arm)
    monkeypatch.setattr(sources_mod, "PSI_POLL_S", 0.02)
    g = setup(tmp_path, {"supervisor": sup, "models": fifo})

    async def go() -> dict:
        g.start(asyncio.get_running_loop())
        await asyncio.sleep(0.1)
        assert g.stages.stage == 0
        sup.write_text(QUIET.replace("some avg10=0.00", "some avg10=15.00"))  # 300 ms / 2 s
        for _ in range(100):
            await asyncio.sleep(0.02)
            if g.stages.stage:
                break
        out = g.pressure_dict()
        g.close()
        return out

    p = asyncio.run(go())
    root = tmp_path / "t" / "cg" / OWN
    assert [(s["role"], s["kind"]) for s in p["sources"]] == [("models", "fifo"),
                                                              ("supervisor", "poll")]
    assert p["triggers_armed"] == 1 and p["stage"] == 1
    assert p["sources"][1]["events"] >= 1 and p["sources"][1]["trigger"] == "some avg10 >= 15%"
    assert p["error"].startswith(f"polling {root / 'supervisor' / 'memory.pressure'} instead "
                                 "of a trigger: ")
    assert "(EPERM)" in p["error"] and "CAP_SYS_RESOURCE" in p["error"]
    err = capsys.readouterr().err
    assert (f"memory pressure: polling {root / 'supervisor' / 'memory.pressure'} (some avg10 "
            ">= 15%) every 0.02 s instead of a trigger: armed ") in err
    assert f"{root / 'supervisor' / 'memory.pressure'} (supervisor): EPERM" in err


def _psi(path: Path, avg10: float, total_us: int) -> None:
    path.write_text(f"some avg10={avg10:.2f} avg60=0.00 avg300=0.00 total={total_us}\n"
                    f"full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def test_release_measures_the_stall_share_since_the_last_event(tmp_path: Path) -> None:
    from edge_agent.cgroup import Trigger
    from edge_agent.daemon.pressure_sources import RATE_MIN_S, PressureSources

    psi = tmp_path / "memory.pressure"
    src = PressureSources(Trigger("some", 300_000, 2_000_000),  # 15 %
                          on_hit=lambda detail: None, stopping=lambda: False)
    src.service_file = psi
    _psi(psi, 40.0, 5_000_000)
    assert src.still_high(100.0)  # no mark yet: avg10 (40 % >= 15 %) decides
    _psi(psi, 40.0, 7_000_000)
    src.mark(200.0)  # a pressure event
    # 5 s later avg10 still says 30 %, but the counter grew 0.1 s: a 2 % share, pressure is over
    _psi(psi, 30.0, 7_100_000)
    assert not src.still_high(205.0)
    _psi(psi, 25.0, 8_100_000)  # 1 s of stall in the next 5 s: 20 %, still high
    assert src.still_high(210.0)
    _psi(psi, 1.0, 9_100_000)  # too soon to measure a share: avg10 decides, the mark stays
    assert not src.still_high(210.0 + RATE_MIN_S / 2)
    assert src.still_high(215.0)  # 1 s in the 5 s since 210: 20 %
    _psi(psi, 50.0, 10)  # the counter restarted (a new group): avg10 decides
    assert src.still_high(220.0)
    psi.unlink()  # unreadable: nothing says pressure is high
    assert not src.still_high(225.0)
