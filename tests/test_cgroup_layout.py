"""The supervisor/models layout on a temporary tree that follows (and breaks) the kernel's rules."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
from cgroup_fake import Tree, make_tree

from edge_agent.cgroup.fs import CgroupError
from edge_agent.cgroup.layout import CgroupManager, Op, join_cgroup
from edge_agent.cgroup.policy import load_policy, parse_policy
from edge_agent.cgroup.values import CgroupValueError

BASE = "system.slice/edge-agent.service"


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return make_tree(tmp_path, pids=(4242, 4243))


def manager(t: Tree) -> CgroupManager:
    return CgroupManager.detect(t.root)


def read(t: Tree, rel: str, name: str) -> str:
    return (t.mount / rel / name).read_text().strip()


def test_setup_moves_the_daemon_then_delegates_memory(tree: Tree) -> None:
    mgr = manager(tree)
    policy = load_policy("default")
    plan = mgr.plan_setup(policy)
    status = mgr.setup(policy)
    assert status.available and mgr.available and status.reason == ""
    assert read(tree, BASE, "cgroup.procs") == ""
    assert read(tree, f"{BASE}/supervisor", "cgroup.procs").split() == ["4242", "4243"]
    assert read(tree, BASE, "cgroup.subtree_control") == "memory"
    assert read(tree, f"{BASE}/supervisor", "memory.min") == str(32 << 20)
    assert read(tree, f"{BASE}/supervisor", "memory.low") == str(96 << 20)
    assert read(tree, f"{BASE}/models", "cgroup.subtree_control") == "memory"
    # what the dry run shows is exactly what happened, in order
    done = [(k, p, f, v) for k, p, f, v in tree.kernel.log]
    assert done == [(op.kind, op.path, op.file, op.value) for op in plan]
    # the only file of our own unit's group we wrote is cgroup.subtree_control
    assert {f for k, p, f, _ in done if p == BASE and k == "write"} == {"cgroup.subtree_control"}


def test_model_group_lifecycle(tree: Tree) -> None:
    mgr = manager(tree)
    mgr.setup(load_policy("small-board"))
    group = mgr.model_group("smollm2", 700 << 20)
    assert group is not None and group.path == tree.mount / BASE / "models" / "smollm2"
    rel = f"{BASE}/models/smollm2"
    assert read(tree, rel, "memory.high") == str(770703360)  # 1.05 x 700 MiB, whole pages
    assert read(tree, rel, "memory.max") == str(880803840)  # 1.2 x 700 MiB
    assert read(tree, rel, "memory.swap.max") == "0"
    assert read(tree, rel, "memory.oom.group") == "1"
    tree.kernel.add_pid(f"{BASE}/supervisor", 5000)  # the runner, just spawned
    group.attach(5000)
    assert group.pids() == [5000] and 5000 not in mgr.fs.pids(f"{BASE}/supervisor")
    assert group.values()["memory.max"] == str(880803840)
    assert mgr.status.to_dict()["models"] == {"smollm2": rel}
    with pytest.raises(CgroupError) as e:  # the runner is still in it
        mgr.remove("smollm2")
    assert e.value.errno == errno.EBUSY and "stop its runner first" in str(e.value)
    (tree.mount / rel / "cgroup.procs").write_text("")  # the runner exited
    mgr.remove("smollm2")
    assert not (tree.mount / rel).exists() and "smollm2" not in mgr.status.models
    mgr.remove("smollm2")  # already gone: fine


def test_model_group_refuses_bad_names_and_occupied_groups(tree: Tree) -> None:
    mgr = manager(tree)
    mgr.setup(load_policy("default"))
    for bad in ("../x", "Big", "a/b", ""):
        with pytest.raises(CgroupError, match="not a valid name"):
            mgr.model_group(bad, 1 << 20)
    g = mgr.model_group("m", 1 << 20)
    assert g is not None
    tree.kernel.add_pid(f"{BASE}/supervisor", 77)
    g.attach(77)
    with pytest.raises(CgroupError, match=r"already holds pids \[77\]. Hint: unload"):
        mgr.model_group("m", 1 << 20)
    with pytest.raises(CgroupError, match=r"cgroup.procs <- '99'.*ESRCH.*already exited"):
        g.attach(99)


def test_values_are_checked_before_the_kernel_sees_them(tree: Tree) -> None:
    mgr = manager(tree)
    mgr.setup(load_policy("default"))
    n = len(tree.kernel.log)
    with pytest.raises(CgroupValueError, match=r"memory.max <- 'abc'.*EINVAL"):
        mgr._apply(Op("write", f"{BASE}/models", "memory.max", "abc"))
    assert len(tree.kernel.log) == n  # nothing reached the tree


def test_never_writes_our_own_units_attributes(tree: Tree) -> None:
    mgr = manager(tree)
    with pytest.raises(CgroupError, match="attribute of our own unit, owned by systemd"):
        mgr._apply(Op("write", BASE, "memory.max", "1073741824"))
    assert read(tree, BASE, "memory.max") == "max"


def test_kernel_errors_during_setup_leave_a_clear_status(tree: Tree) -> None:
    tree.kernel.fail[(f"{BASE}/supervisor", "cgroup.procs")] = errno.EACCES
    status = manager(tree).setup(load_policy("default"))
    assert not status.available
    assert "supervisor/cgroup.procs <- '4242': Permission denied (EACCES)" in status.reason
    assert "Delegate=yes" in status.reason and status.fix


def test_kernel_einval_on_a_limit_is_reported(tree: Tree) -> None:
    mgr = manager(tree)
    mgr.setup(load_policy("default"))
    tree.kernel.fail[(f"{BASE}/models/m", "memory.high")] = errno.EINVAL
    with pytest.raises(CgroupError, match=r"memory.high <- '\d+': Invalid argument \(EINVAL\)"):
        mgr.model_group("m", 1 << 30)


def test_a_process_that_appears_after_planning_is_moved_too(tree: Tree) -> None:
    mgr = manager(tree)
    policy = load_policy("default")
    real_write = tree.kernel.write

    def write(path: Path, value: str) -> None:
        real_write(path, value)
        if path.name == "cgroup.procs" and value == "4243":
            tree.kernel.add_pid(BASE, 4300)  # forked by the daemon meanwhile

    tree.kernel.write = write  # type: ignore[method-assign]  # a kernel that forks meanwhile
    assert mgr.setup(policy).available
    assert read(tree, f"{BASE}/supervisor", "cgroup.procs").split() == ["4242", "4243", "4300"]


def test_without_a_subtree_nothing_is_written(tmp_path: Path) -> None:
    t = make_tree(tmp_path, delegated=False)
    mgr = manager(t)
    status = mgr.setup(load_policy("default"))
    assert not status.available and "not delegated" in status.reason
    assert status.to_dict()["fix"] and mgr.model_group("m", 1 << 20) is None
    mgr.remove("m")
    assert mgr.teardown() == [] and t.kernel.log == []


def test_restart_is_idempotent_and_cleans_stale_groups(tree: Tree) -> None:
    mgr = manager(tree)
    mgr.setup(load_policy("default"))
    mgr.model_group("old", 1 << 20)
    mgr.model_group("busy", 1 << 20)
    tree.kernel.add_pid(f"{BASE}/models/busy", 9)
    # a new daemon process, already inside supervisor/ (same cgroup after an exec)
    (tree.proc / "self" / "cgroup").write_text(f"0::/{BASE}/supervisor\n")
    again = manager(tree)
    assert again.detection.already_set_up
    status = again.setup(load_policy("default"))
    assert status.available
    assert not (tree.mount / BASE / "models" / "old").exists()
    assert (tree.mount / BASE / "models" / "busy").exists()
    assert any("stale group" in w and "[9]" in w for w in status.warnings)


def test_missing_swap_accounting_is_a_warning(tmp_path: Path) -> None:
    t = make_tree(tmp_path)
    t.kernel.swap_accounting = False
    mgr = manager(t)
    mgr.setup(load_policy("default"))
    assert mgr.model_group("m", 1 << 20) is not None
    assert any("memory.swap.max missing" in w for w in mgr.status.warnings)


def test_teardown_removes_models(tree: Tree) -> None:
    mgr = manager(tree)
    mgr.setup(parse_policy("p", {"model": {"memory_high": "max", "memory_max": "max"}}))
    for name in ("a", "b"):
        mgr.model_group(name, None)
    assert read(tree, f"{BASE}/models/a", "memory.max") == "max"
    assert mgr.teardown() == []
    assert not (tree.mount / BASE / "models").exists()
    assert (tree.mount / BASE / "supervisor").exists() and not mgr.available


def test_snapshot_shows_the_subtree(tree: Tree) -> None:
    mgr = manager(tree)
    mgr.setup(load_policy("default"))
    mgr.model_group("m", 64 << 20)
    snap = mgr.snapshot()
    groups = snap["groups"]
    assert set(groups) == {BASE, f"{BASE}/supervisor", f"{BASE}/models", f"{BASE}/models/m"}
    assert groups[f"{BASE}/models/m"]["memory.events"]["oom_kill"] == "0"
    assert groups[f"{BASE}/supervisor"]["pids"] == [4242, 4243]


def test_join_cgroup_writes_zero_from_the_child(tmp_path: Path) -> None:
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    code = ("import sys; from edge_agent.cgroup.layout import join_cgroup; "
            "join_cgroup(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(procs)], check=True)
    assert procs.read_text() == "0"  # the kernel reads "0" as "the writing process"
    with pytest.raises(FileNotFoundError):
        join_cgroup(tmp_path / "missing" / "cgroup.procs")
