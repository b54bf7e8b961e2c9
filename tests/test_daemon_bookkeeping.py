"""Control-plane bookkeeping, in process (no runner, no socket): a load that fails with an
unexpected exception leaves LOADING for FAILED and answers the waiting requests; a request that
ended (cancel/expiry) before its runner reported is counted once in the metrics; a state
directory that is a file stops `serve` with exit 78 and a hint."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_agent.config import load_config
from edge_agent.daemon.app import Daemon
from edge_agent.daemon.outcome import Outcome
from edge_agent.protocol.api import END_STATUS, parse_generation
from edge_agent.scheduler import JobState, ModelState


def _daemon(tmp_path: Path) -> Daemon:
    cfg = load_config(None, env={}, check_paths=False, overrides={
        "server.socket": str(tmp_path / "s.sock"), "server.state_dir": str(tmp_path),
        "journal.enabled": False, "cgroup.enabled": False, "models.smollm2.context": 256})
    return Daemon(cfg, env={})


def _submit(d: Daemon, prompt: str = "Hello") -> object:
    return d.submit(parse_generation({"prompt": prompt, "max_tokens": 4}, chat=False,
                                     max_tokens_limit=64))


def test_unexpected_load_error_fails_the_model_and_its_requests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        d = _daemon(tmp_path)
        svc = d.services["smollm2"]
        rec = _submit(d)

        def broken() -> None:  # a bug-shaped failure: not an EdgeAgentError nor an OSError
            raise KeyError("n_layers")

        monkeypatch.setattr(svc, "_runner_args", broken)
        await svc._load()
        assert svc.lifecycle.state is ModelState.FAILED
        assert "KeyError" in (svc.lifecycle.reason or "") and "Hint:" in svc.lifecycle.reason
        assert rec.done.is_set() and rec.outcome is not None
        assert END_STATUS[rec.outcome.code or ""] == 503 and rec.outcome.code == "model_failed"
        assert d.metrics.requests[("smollm2", "failed")] == 1
        assert svc.runner is None

    asyncio.run(go())


def test_request_ended_before_its_result_is_counted_once(tmp_path: Path) -> None:
    async def go() -> None:
        d = _daemon(tmp_path)
        rec = _submit(d)
        now = time.monotonic()
        d.scheduler.take("smollm2", 4, now + 1.0)  # running
        d.cancel(rec.id)  # the client went away
        assert d.metrics.requests[("smollm2", "cancelled")] == 1
        # the runner's last token arrives late, then a failure
        assert not d.requests.finish(rec.id, Outcome.done("stop"), now)
        assert not d.requests.finish(rec.id, Outcome.failed("runner_error", "late failure"), now)
        assert d.metrics.requests[("smollm2", "done")] == 0
        assert d.metrics.requests[("smollm2", "failed")] == 0
        assert rec.outcome is not None and rec.outcome.code is None
        assert rec.finish_reason == "cancelled"
        assert d.scheduler.get(rec.id).state is JobState.CANCELLED

    asyncio.run(go())


def test_state_dir_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    """`serve --state-dir FILE`: exit 78 with the key, the path and a hint, not a traceback."""
    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    r = subprocess.run([sys.executable, "-m", "edge_agent", "serve", "--state-dir", str(afile),
                        "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 78, r.stderr
    assert f"server.state_dir {afile}: cannot create the state directory" in r.stderr
    assert "Hint:" in r.stderr and "Traceback" not in r.stderr
