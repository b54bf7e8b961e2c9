"""The daemon's start, in process with a real runner and a real journal: a llama.cpp preload
model's runner is spawned before the journal opens, so its load overlaps the journal's
integrity check and recovery, and its load still ends with the journal open (its outcome is
journaled); a model whose load must wait for the journal (numpy engine, not preloaded, not
fitting) waits. The processes a start leaves: the control plane imports no numpy (the runner
does its computing), the runner no asyncio (the control plane does the networking)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edge_agent.config import load_config
from edge_agent.daemon.app import Daemon
from edge_agent.runtime.llama_vocab import llama_available
from edge_agent.scheduler import ModelState

REPO = Path(__file__).resolve().parents[1]
needs_llama = pytest.mark.skipif(not llama_available(), reason="llama-cpp-python not installed")


def _daemon(tmp_path: Path, **overrides: Any) -> Daemon:
    cfg = load_config(None, env={}, check_paths=False, overrides={
        "server.socket": str(tmp_path / "s.sock"), "server.state_dir": str(tmp_path),
        "cgroup.enabled": False, "runtime.engine": "llamacpp",
        "models.smollm2.preload": True, "models.smollm2.context": 256,
        "models.smollm2.max_batch": 2, **overrides})
    return Daemon(cfg, env={})


@needs_llama
def test_preload_runner_is_spawned_before_the_journal_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        d = _daemon(tmp_path)
        svc = d.services["smollm2"]
        seen: dict[str, Any] = {}
        journal_open, model_loaded = d.journal.open, d.journal.model_loaded

        def open_() -> Any:
            seen["pid at open"] = svc.runner.pid if svc.runner is not None else None
            seen["state at open"] = svc.lifecycle.state
            return journal_open()

        def loaded(*args: Any, **kwargs: Any) -> None:
            seen["journal open when loaded"] = d.journal.store is not None
            model_loaded(*args, **kwargs)

        monkeypatch.setattr(d.journal, "open", open_)
        monkeypatch.setattr(d.journal, "model_loaded", loaded)
        d.state_lock.acquire()
        try:
            await d.startup()
            assert isinstance(seen["pid at open"], int)  # the runner exists, loading
            assert seen["state at open"] is ModelState.LOADING
            assert seen["journal open when loaded"] is True
            assert svc.lifecycle.state in (ModelState.IDLE, ModelState.SERVING)
            assert d.ready
        finally:
            await d.shutdown()
            d.state_lock.release()

    asyncio.run(go())


@pytest.mark.parametrize("overrides", [
    {"runtime.engine": "numpy"},  # its tokenizer comes from the journal's cache
    {"models.smollm2.preload": False},  # loaded on demand, once a request asks
    {"runtime.memory_budget_bytes": "1MiB"},  # does not fit: its refusal is journaled
], ids=["numpy engine", "not preloaded", "does not fit"])
def test_other_loads_wait_for_the_journal(tmp_path: Path, overrides: dict[str, Any]) -> None:
    if overrides.get("runtime.engine") != "numpy" and not llama_available():
        pytest.skip("llama-cpp-python not installed")
    d = _daemon(tmp_path, **overrides)
    assert d.services["smollm2"].loads_before_journal() is False


@needs_llama
def test_a_start_leaves_numpy_out_of_the_control_plane_and_asyncio_out_of_the_runner(
        tmp_path: Path) -> None:
    """What `serve` runs before READY, on the llama.cpp engine: the CLI, the daemon's modules,
    the model's budget from its GGUF, its vocabulary, the journal. numpy would cost the
    control plane 13 MiB of PSS and 0.1 s of start, importlib.metadata 1.4 MiB; asyncio the
    runner 3 MiB. sqlite-utils (~50 ms) is imported by the journal's first open, which comes
    after the first runner's spawn."""
    control = f"""
import sys
from pathlib import Path
from edge_agent.cli import build_parser
build_parser().parse_args(["serve", "--print-config"])
import edge_agent.daemon.app
from edge_agent.journal import open_journal
assert "sqlite_utils" not in sys.modules  # imported when the journal opens, after the spawn
from edge_agent.paths import default_model_path
from edge_agent.runtime.engines import model_facts, open_tokenizer
assert model_facts(default_model_path()).n_layers > 0
assert open_tokenizer("llamacpp", default_model_path()).encode("Hello")
open_journal(Path({str(tmp_path / "j.sqlite3")!r})).close()
assert "sqlite_utils" in sys.modules
print(sorted(m for m in ("numpy", "pandas", "importlib.metadata") if m in sys.modules))
import numpy  # hidden from sqlite-utils only while it was imported
print(numpy.__name__)
"""
    runner = """
import sys
import edge_agent.daemon.runner, edge_agent.runtime.llamacpp
print("asyncio" in sys.modules, "numpy" in sys.modules)
"""
    out = [subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True).stdout.split()
           for code in (control, runner)]
    assert out[0] == ["[]", "numpy"]
    assert out[1] == ["False", "True"]  # the runner computes with numpy
