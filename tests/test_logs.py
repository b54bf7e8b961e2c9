"""Log lines on stderr: `edge-agent: LEVEL: message` in a terminal, with the syslog priority in
front of every line when stderr is the journal stream systemd names in $JOURNAL_STREAM.

The formatter and the stream check are unit-tested on real files; a real daemon subprocess
whose stderr is a file named by JOURNAL_STREAM writes its warning as `<4>...` and its info lines
as `<6>...` (what journald turns into priorities), and so does its runner.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import Daemon, daemon_env, serve_argv, spawn, stop
from journal_harness import tiny_gguf

from edge_agent import cli
from edge_agent.logs import (
    LineFormatter,
    StderrHandler,
    configure,
    journal_stream_matches,
    syslog_priority,
)


def _record(level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("edge_agent.daemon.app", level, __file__, 1, msg, args, None)


def _stream_id(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root, logger = logging.getLogger(), logging.getLogger("edge_agent")
    handlers, level = list(root.handlers), logger.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        logger.setLevel(level)


LEVELS = [(logging.DEBUG, 7, "edge-agent: debug: x=1"), (logging.INFO, 6, "edge-agent: x=1"),
          (logging.WARNING, 4, "edge-agent: warning: x=1"),
          (logging.ERROR, 3, "edge-agent: error: x=1"),
          (logging.CRITICAL, 2, "edge-agent: critical: x=1")]


@pytest.mark.parametrize(("level", "priority", "plain"), LEVELS)
def test_each_level_plain_and_with_its_journal_priority(level: int, priority: int,
                                                        plain: str) -> None:
    assert syslog_priority(level) == priority
    assert LineFormatter().format(_record(level, "x=%d", 1)) == plain
    assert LineFormatter(journal=True).format(_record(level, "x=%d", 1)) == f"<{priority}>{plain}"


def test_every_line_of_a_multi_line_record_carries_the_priority() -> None:
    rec = _record(logging.ERROR, "Traceback (most recent call last):\n  File x\nRuntimeError: y")
    assert LineFormatter(journal=True).format(rec).split("\n") == [
        "<3>edge-agent: error: Traceback (most recent call last):", "<3>  File x",
        "<3>RuntimeError: y"]
    assert LineFormatter().format(rec).split("\n")[1:] == ["  File x", "RuntimeError: y"]


def test_journal_stream_matches_only_the_file_it_names(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("")
    b.write_text("")
    with a.open("w") as fa:
        assert journal_stream_matches({"JOURNAL_STREAM": _stream_id(a)}, fa)
        assert not journal_stream_matches({"JOURNAL_STREAM": _stream_id(b)}, fa)  # redirected
        assert not journal_stream_matches({}, fa)
        for bad in ("", "12", "x:y", "1:2:3", ":"):
            assert not journal_stream_matches({"JOURNAL_STREAM": bad}, fa), bad
    assert not journal_stream_matches({"JOURNAL_STREAM": _stream_id(a)}, io.StringIO())
    closed = a.open("w")
    closed.close()
    assert not journal_stream_matches({"JOURNAL_STREAM": _stream_id(a)}, closed)


def test_configure_prefixes_only_when_stderr_is_the_journal_stream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_logging: None) -> None:
    out = tmp_path / "stderr"
    log = logging.getLogger("edge_agent.daemon.app")
    with out.open("w") as fh:
        monkeypatch.setattr(sys, "stderr", fh)
        configure(logging.INFO, env={"JOURNAL_STREAM": _stream_id(out)})
        log.warning("journal: write dropped")
        log.debug("not shown at INFO")
        configure(logging.DEBUG, env={"JOURNAL_STREAM": "1:2"})  # again: replaces the handler
        log.info("listening on x")
        log.debug("shown at DEBUG")
    assert out.read_text().splitlines() == ["<4>edge-agent: warning: journal: write dropped",
                                            "edge-agent: listening on x",
                                            "edge-agent: debug: shown at DEBUG"]
    assert sum(isinstance(h, StderrHandler) for h in logging.getLogger().handlers) == 1


@pytest.mark.parametrize(("flags", "level"), [([], logging.INFO), (["-v"], logging.DEBUG),
                                              (["-q"], logging.WARNING),
                                              (["--quiet"], logging.WARNING)])
def test_cli_verbosity_flags_set_the_level(flags: list[str], level: int, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           restore_logging: None) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nsocket = "{tmp_path / "s.sock"}"\nstate_dir = "{tmp_path}"\n')
    assert cli.main([*flags, "serve", "--config", str(cfg), "--print-config"]) == 0
    assert logging.getLogger("edge_agent").level == level
    assert cli.main(["serve", "--config", str(cfg), "--print-config", *flags]) == 0  # after it
    assert logging.getLogger("edge_agent").level == level


def test_cli_errors_are_error_records(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      restore_logging: None) -> None:
    assert cli.main(["-q", "serve", "--config", str(tmp_path / "absent.toml")]) == 78
    assert capsys.readouterr().err.startswith(
        f"edge-agent: error: configuration file {tmp_path / 'absent.toml'}: does not exist")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_daemon_under_systemd_writes_journal_priorities() -> None:
    base = Path(tempfile.mkdtemp(prefix="ea-lg-", dir="/tmp"))
    d = None
    try:
        tiny = tiny_gguf(base / "tiny.gguf")
        (base / "config.toml").write_text(
            f'default_model = "tiny"\n'
            f'[server]\nsocket = "{base / "ea.sock"}"\nstate_dir = "{base / "state"}"\n'
            f'[runtime]\nmlock = "off"\nthreads = 1\n[journal]\nenabled = false\n'
            f'[models.tiny]\npath = "{tiny}"\ncontext = 1048576\nmax_batch = 1\n'
            f"preload = true\n")
        log = base / "daemon.log"
        log.write_bytes(b"")  # the file systemd would hand over; the daemon appends to it
        env = daemon_env(base, {"JOURNAL_STREAM": _stream_id(log)})
        d = spawn(Daemon, base, serve_argv(base / "config.toml"), env=env, append_log=True)
        d.wait_notify("READY=1", 120)
        status, body = d.json("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200, body
        assert stop(d, grace=30) == 0
        lines = log.read_text().splitlines()
        assert any(ln.startswith("<4>edge-agent: warning: models.tiny.context = 1048576 is "
                                 "more than model 'tiny' was trained for") for ln in lines), lines
        assert any(ln.startswith("<6>edge-agent: listening on ") for ln in lines), lines
        assert "<6>edge-agent: stopped" in lines, lines
        plain = [ln for ln in lines if "edge-agent:" in ln and not ln.startswith("<")]
        assert not plain, lines  # the runner's lines (same stderr, same variable) as well
    finally:
        if d is not None:
            stop(d)
        shutil.rmtree(base, ignore_errors=True)
