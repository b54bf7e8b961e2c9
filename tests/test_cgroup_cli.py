"""`edge-agent cgroup show|apply --dry-run` through cli.main: output, JSON, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgroup_fake import make_tree

from edge_agent.cgroup.layout import CgroupManager
from edge_agent.cgroup.policy import load_policy
from edge_agent.cli import main

BASE = "system.slice/edge-agent.service"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["cgroup", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_show_on_this_host(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "--json")
    assert code == 0 and err == ""
    snap = json.loads(out)
    assert set(snap) == {"detection", "status", "groups", "pressure"}
    assert isinstance(snap["detection"]["available"], bool)
    code, out, _ = run(capsys, "show")
    assert code == 0 and out.startswith("cgroup v2:   ")
    if not snap["detection"]["available"]:
        assert "  missing:   " in out and "  fix:       " in out


def test_show_a_set_up_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = make_tree(tmp_path)
    mgr = CgroupManager.detect(t.root)
    mgr.setup(load_policy("default"))
    mgr.model_group("smollm2", 700 << 20)
    (t.proc / "self" / "cgroup").write_text(f"0::/{BASE}/supervisor\n")
    code, out, _ = run(capsys, "show", "--proc-root", str(t.proc))
    assert code == 0
    assert "cgroup v2:   available" in out and "(already set up)" in out
    assert f"{BASE}/models/smollm2/" in out
    assert "  memory.max         1027604480" in out  # 1.4 x 700 MiB in whole pages
    assert "  memory.events      low=0 high=0 max=0 oom=0 oom_kill=0 oom_group_kill=0" in out
    code, out, _ = run(capsys, "show", "--json", "--proc-root", str(t.proc))
    snap = json.loads(out)
    assert snap["groups"][f"{BASE}/supervisor"]["memory.low"] == str(96 << 20)
    assert snap["pressure"]["some_avg10"] == 0.0


def test_apply_dry_run_prints_every_write_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = make_tree(tmp_path)
    before = sorted(p.name for p in (t.mount / BASE).iterdir())
    code, out, err = run(capsys, "apply", "--dry-run", "--policy", "small-board", "--model",
                         "smollm2", "--budget", "700M", "--proc-root", str(t.proc))
    assert code == 0 and err == ""
    g = t.mount / BASE
    assert out.splitlines() == [
        f"# policy small-board ({load_policy('small-board').path}): dry run, nothing written",
        f"mkdir  {g}/supervisor  # leaf for the control plane",
        f"write  {g}/supervisor/cgroup.procs <- 4242  # no processes in inner nodes",
        f"write  {g}/cgroup.subtree_control <- +memory  # hand the memory controller to our "
        "children",
        f"write  {g}/supervisor/memory.min <- {24 << 20}  # protect the control plane "
        "(small-board)",
        f"write  {g}/supervisor/memory.low <- {64 << 20}  # protect the control plane "
        "(small-board)",
        f"mkdir  {g}/models  # parent of the runner groups",
        f"write  {g}/models/cgroup.subtree_control <- +memory  # limits per runner",
        f"mkdir  {g}/models/smollm2  # runner of model smollm2",
        f"write  {g}/models/smollm2/memory.high <- 770703360  # small-board, budget 734003200 "
        "bytes",
        f"write  {g}/models/smollm2/memory.max <- 880803840  # small-board, budget 734003200 "
        "bytes",
        f"write  {g}/models/smollm2/memory.swap.max <- 0  # small-board, budget 734003200 bytes",
        f"write  {g}/models/smollm2/memory.oom.group <- 1  # small-board, budget 734003200 bytes",
    ]
    assert sorted(p.name for p in g.iterdir()) == before
    code, out, _ = run(capsys, "apply", "--dry-run", "--json", "--proc-root", str(t.proc))
    doc = json.loads(out)
    assert doc["available"] is True and doc["policy"]["name"] == "default"
    assert doc["writes"][0] == {"op": "mkdir", "path": f"{BASE}/supervisor", "file": None,
                                "value": None, "why": "leaf for the control plane"}


def test_apply_on_a_host_without_a_subtree_says_so(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    t = make_tree(tmp_path, v1_memory=True)
    code, out, err = run(capsys, "apply", "--dry-run", "--proc-root", str(t.proc))
    assert code == 0 and "mkdir " in out
    assert "cgroup v2 is not usable here (the memory controller is bound to the cgroup v1" in err
    assert "systemd.unified_cgroup_hierarchy=1" in err


@pytest.mark.parametrize("argv, code, needle", [
    (["apply"], 2, "--dry-run"),
    (["apply", "--dry-run", "--budget", "1G"], 2, "--budget given without --model"),
    # a bad flag value is a usage error (2), as --budget without --model is
    (["apply", "--dry-run", "--model", "m", "--budget", "lots"], 2,
     "cgroup apply --budget 'lots'"),
    (["apply", "--dry-run", "--model", "m", "--budget", "max"], 2, "no limit here"),
    (["apply", "--dry-run", "--model", "m", "--budget", "0"], 2, "would plan memory.max 0"),
    (["apply", "--dry-run", "--policy", "nope"], 78, "cgroup policy 'nope': not found"),
    (["apply", "--dry-run", "--model", "m"], 78, "needs the model's budget"),
    (["apply", "--dry-run", "--model", "Bad/Name", "--budget", "1G"], 1, "not a valid name"),
    ([], 2, "ACTION"),
])
def test_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
                   needle: str) -> None:
    try:
        got = main(["cgroup", *argv])
    except SystemExit as exc:  # argparse usage errors
        got = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert got == code and needle in err and out == ""
