"""systemd units: directives the issue requires, `edge-agent systemd install`, and systemd's own
checkers (`systemd-analyze verify`, `systemd-sysusers --root`, `systemd-tmpfiles --root`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent import cli
from edge_agent.commands.systemd import default_exec_start
from edge_agent.errors import EXIT_ERROR, EXIT_USAGE
from edge_agent.systemd_units import UnitOptions, render_units

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "systemd"


def directives(text: str) -> dict[str, list[str]]:
    """KEY -> values, in order ('[Section]' lines and comments skipped)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"SKIPPED LOUDLY: {name} is not installed (Debian package `systemd`; "
                    "`make deps-debian` installs it): systemd's own check of the units did "
                    "not run")
    return path


def install(tmp_path: Path, *extra: str) -> dict[str, Path]:
    args = ["systemd", "install", "--prefix", str(tmp_path / "system"),
            "--sysusers-dir", str(tmp_path / "sysusers.d"),
            "--tmpfiles-dir", str(tmp_path / "tmpfiles.d"), *extra]
    assert cli.main(args) == 0
    return {
        "service": tmp_path / "system" / "edge-agent.service",
        "socket": tmp_path / "system" / "edge-agent.socket",
        "sysusers": tmp_path / "sysusers.d" / "edge-agent.conf",
        "tmpfiles": tmp_path / "tmpfiles.d" / "edge-agent.conf",
    }


def test_shipped_files_are_the_rendered_defaults() -> None:
    for name, text in render_units().items():
        assert (SHIPPED / name).read_text() == text, (
            f"systemd/{name} differs from edge_agent.systemd_units.render_units(); regenerate it"
        )


def test_service_has_the_required_directives() -> None:
    d = directives(render_units()["edge-agent.service"])
    expected = {
        "Type": "notify", "NotifyAccess": "main", "Restart": "on-failure",
        "RestartPreventExitStatus": "78", "Delegate": "yes", "LimitMEMLOCK": "infinity",
        "LimitNOFILE": "8192",
        "StateDirectory": "edge-agent", "RuntimeDirectory": "edge-agent",
        "RuntimeDirectoryPreserve": "yes", "User": "edge-agent",
        "SupplementaryGroups": "dialout", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "CAP_IPC_LOCK CAP_SYS_RESOURCE",
        "AmbientCapabilities": "CAP_IPC_LOCK CAP_SYS_RESOURCE", "Requires": "edge-agent.socket",
    }
    for key, value in expected.items():
        assert d.get(key) == [value], f"{key}: {d.get(key)}"
    assert int(d["WatchdogSec"][0]) >= 10
    assert int(d["TimeoutStartSec"][0]) >= 120
    # A delegated cgroup subtree must stay writable; the UART is a device.
    assert "ProtectControlGroups" not in d and "PrivateDevices" not in d
    assert d["ExecStart"] == ["/usr/bin/edge-agent serve"]


def test_cap_sys_resource_says_why_and_when_to_drop_it() -> None:
    """Kernel < 6.5 opens memory.pressure for writing (a PSI trigger) only with
    CAP_SYS_RESOURCE; the unit grants it next to CAP_IPC_LOCK and says when it can go."""
    text = render_units()["edge-agent.service"]
    lines = text.splitlines()
    at = lines.index("CapabilityBoundingSet=CAP_IPC_LOCK CAP_SYS_RESOURCE")
    comment = " ".join(ln.lstrip("# ") for ln in lines[at - 5:at])
    for needle in ("CAP_SYS_RESOURCE: Linux < 6.5", "arm a PSI trigger", "drops it right after "
                   "arming", "Remove it on kernels >= 6.5", "systemd >= 254"):
        assert needle in comment, (needle, comment)
    assert lines[at + 1] == "AmbientCapabilities=CAP_IPC_LOCK CAP_SYS_RESOURCE"


def test_socket_unit() -> None:
    d = directives(render_units()["edge-agent.socket"])
    assert d["ListenStream"] == ["/run/edge-agent/edge-agent.sock"]
    assert d["SocketMode"] == ["0660"] and d["SocketGroup"] == ["edge-agent"]
    assert d["FileDescriptorName"] == ["api"]


def test_install_writes_units_for_this_python(tmp_path: Path) -> None:
    files = install(tmp_path)
    service = directives(files["service"].read_text())
    assert service["ExecStart"] == [default_exec_start()]
    assert service["ExecStart"][0].startswith(sys.executable + " -m edge_agent serve")
    for path in files.values():
        assert path.stat().st_mode & 0o777 == 0o644
    assert "m edge-agent dialout" in files["sysusers"].read_text()


def test_install_user_and_exec_start_options(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["systemd", "install", "--dry-run", "--user", "llm",
                     "--exec-start", "/home/me/venv/bin/python -m edge_agent serve"]) == 0
    captured = capsys.readouterr()
    d = directives(captured.out)
    assert d["User"] == ["llm"] and d["SocketGroup"] == ["llm"]
    assert d["ProtectHome"] == ["read-only"]  # the installation lives under /home
    assert "# ---- /etc/systemd/system/edge-agent.service" in captured.out
    assert "# ---- /etc/sysusers.d/edge-agent.conf" in captured.out
    assert "u llm - " in captured.out and "ProtectHome=read-only" in captured.err


def test_dry_run_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["systemd", "install", "--dry-run", "--prefix", str(tmp_path / "x")]) == 0
    assert not (tmp_path / "x").exists()
    assert "Type=notify" in capsys.readouterr().out


def test_install_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["systemd", "install", "--dry-run", "--user", "Bad User"]) == EXIT_USAGE
    assert "not a valid system user name. Hint:" in capsys.readouterr().err
    assert cli.main(["systemd", "install", "--dry-run", "--exec-start", "edge-agent serve"]) \
        == EXIT_USAGE
    assert "must be an absolute path" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["systemd", "install", "--prefix", str(blocker / "sub")]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"writing {blocker / 'sub' / 'edge-agent.service'}" in err
    assert "Hint: run it as root" in err
    with pytest.raises(SystemExit) as exc:  # no action: a usage error with its Hint line
        cli.main(["systemd"])
    assert exc.value.code == EXIT_USAGE
    assert "error: the following arguments are required: ACTION" in capsys.readouterr().err


def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    tool = need_tool("systemd-analyze")
    files = install(tmp_path)
    result = subprocess.run([tool, "verify", str(files["service"]), str(files["socket"])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    # The check above can fail: the same tool rejects a missing executable.
    tool = need_tool("systemd-analyze")
    files = install(tmp_path, "--exec-start", str(tmp_path / "no-such-python") + " serve")
    result = subprocess.run([tool, "verify", str(files["service"]), str(files["socket"])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no-such-python" in result.stderr


def test_sysusers_and_tmpfiles_apply_to_a_scratch_root(tmp_path: Path) -> None:
    sysusers = need_tool("systemd-sysusers")
    tmpfiles = need_tool("systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: systemd-tmpfiles --root needs root to chown")
    files = install(tmp_path)
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([sysusers, f"--root={root}", str(files["sysusers"])], check=True,
                   capture_output=True, timeout=60)
    passwd = (root / "etc" / "passwd").read_text()
    group = (root / "etc" / "group").read_text()
    user = next(line for line in passwd.splitlines() if line.startswith("edge-agent:"))
    assert user.endswith(":/var/lib/edge-agent:/usr/sbin/nologin")
    dialout = next(line for line in group.splitlines() if line.startswith("dialout:"))
    assert dialout.split(":")[3] == "edge-agent"
    subprocess.run([tmpfiles, f"--root={root}", "--create", str(files["tmpfiles"])], check=True,
                   capture_output=True, timeout=60)
    uid = int(user.split(":")[2])
    state = (root / "var" / "lib" / "edge-agent").stat()
    assert state.st_uid == uid and state.st_mode & 0o777 == 0o750
    assert (root / "run" / "edge-agent").stat().st_uid == uid


# ---- hardening (systemd-analyze security <= 2.0) -------------------------------------------
def test_service_hardening_without_tcp() -> None:
    d = directives(render_units()["edge-agent.service"])
    for key, value in {"SystemCallFilter": "@system-service", "SystemCallErrorNumber": "EPERM",
                       "ProtectProc": "invisible", "PrivateMounts": "yes",
                       "MemoryDenyWriteExecute": "yes", "IPAddressDeny": "any",
                       "PrivateNetwork": "yes", "RestrictAddressFamilies": "AF_UNIX",
                       "UMask": "0027"}.items():
        assert d.get(key) == [value], f"{key}: {d.get(key)}"
    assert "IPAddressAllow" not in d
    # /proc/pressure/memory is watched; CAP_IPC_LOCK must count in the host user namespace
    assert "ProcSubset" not in d and "PrivateUsers" not in d


def test_service_with_tcp_allows_loopback_only() -> None:
    d = directives(render_units(UnitOptions(tcp=True))["edge-agent.service"])
    assert d["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert d["IPAddressDeny"] == ["any"] and d["IPAddressAllow"] == ["localhost"]
    assert "PrivateNetwork" not in d
    assert d["SystemCallFilter"] == ["@system-service"]


def test_install_follows_server_tcp(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EDGE_AGENT_SERVER__TCP", "127.0.0.1:8080")
    assert cli.main(["systemd", "install", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert directives(captured.out)["IPAddressAllow"] == ["localhost"]
    assert "server.tcp = '127.0.0.1:8080' is configured" in captured.err
    assert cli.main(["systemd", "install", "--dry-run", "--no-tcp"]) == 0
    d = directives(capsys.readouterr().out)
    assert d["RestrictAddressFamilies"] == ["AF_UNIX"] and "IPAddressAllow" not in d


@pytest.mark.parametrize("tcp", [False, True])
def test_systemd_analyze_security_score(tmp_path: Path, tcp: bool) -> None:
    tool = need_tool("systemd-analyze")
    unit = tmp_path / "edge-agent.service"
    unit.write_text(render_units(UnitOptions(tcp=tcp))["edge-agent.service"])
    result = subprocess.run([tool, "security", "--offline=yes", str(unit)],
                            capture_output=True, text=True, timeout=120)
    line = next(ln for ln in result.stdout.splitlines() if "Overall exposure level" in ln)
    score = float(line.split(":")[1].split()[0])
    assert score <= 2.0, result.stdout[-3000:]


def test_install_byte_compiles_the_installation(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The service cannot write the installation (ProtectSystem=strict, its own user): the
    install leaves current bytecode for every module, or says which directory it could not."""
    import compileall
    import importlib.util

    import edge_agent.daemon.app
    import firmware_tools.image

    cached = [Path(importlib.util.cache_from_source(m.__file__ or ""))
              for m in (edge_agent.daemon.app, firmware_tools.image)]
    for path in cached:
        path.unlink(missing_ok=True)
    install(tmp_path)
    assert all(path.is_file() for path in cached)
    assert "could not byte-compile" not in capsys.readouterr().err

    def read_only(*_args: object, **_kwargs: object) -> bool:
        return False  # what compileall reports for a directory it may not write

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compileall, "compile_dir", read_only)
        install(tmp_path)  # still installs: the units are written, exit 0
    err = capsys.readouterr().err
    assert f"{Path(edge_agent.__file__).parent}: could not byte-compile" in err
    assert "Hint:" in err
