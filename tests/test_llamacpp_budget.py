"""The memory budget of a llama.cpp runner matches what the runner really holds.

The budget (weights as stored + KV cache + compute buffers + the process) is what memory
planning and the model's cgroup limits (memory.high / memory.max) are computed from, before a
runner exists; it must be within 15 % of the loaded runner's resident set, for both shipped
models, after long prompts have touched the compute buffers.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import Daemon, launch, serve_argv

from edge_agent.paths import default_model_path

pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert m, status
    return int(m.group(1)) * 1024


@pytest.fixture(scope="module")
def daemon(gemma_path: Path) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-bud-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        '[runtime]\nengine = "llamacpp"\nthreads = 2\n[journal]\nenabled = false\n'
        f'[models.smollm2]\npath = "{default_model_path()}"\ncontext = 512\nmax_batch = 4\n'
        f'[models.gemma]\npath = "{gemma_path}"\ncontext = 512\nmax_batch = 4\n'
        f'[models.gemma-embed]\npath = "{gemma_path}"\ncontext = 512\nmax_batch = 4\n'
        'pooling = "mean"\n')
    with launch(Daemon, root, serve_argv(cfg)) as d:
        yield d


def _verdict(model: str, gemma_path: Path) -> bool:
    """The batch-invariance probe's verdict in this process, shaped as the daemon loads the
    model: /health must report what its runner's warm-up measured (on this CPU: Gemma 3's
    kernels switch with the rows in a step, SmolLM2's do not; test_llamacpp_engine.py)."""
    from edge_agent.runtime.llamacpp import LlamaCppEngine

    path = default_model_path() if model == "smollm2" else gemma_path
    with LlamaCppEngine.load(path, max_batch=4, context=512, threads=2, mlock="off") as e:
        return e.batch_invariance(())


@pytest.mark.parametrize("model", ["smollm2", "gemma"])
def test_budget_within_15_percent_of_the_runner_rss(daemon: Daemon, model: str,
                                                    gemma_path: Path) -> None:
    for n in (40, 160):  # a short and a long prefill (the long one fills a 512-token chunk)
        status, r = daemon.json("POST", "/v1/completions", {
            "model": model, "prompt": "hello world, " * n, "max_tokens": 8})
        assert status == 200, r
    m = daemon.health()["models"][model]
    assert m["engine"] == "llamacpp"
    assert m["batch_invariant"] is _verdict(model, gemma_path), m
    rss = _rss(int(m["runner_pid"]))
    ratio = m["budget_bytes"] / rss
    assert 0.85 <= ratio <= 1.15, (f"{model}: budget {m['budget_bytes'] >> 20} MiB, runner RSS "
                                   f"{rss >> 20} MiB, ratio {ratio:.3f}")


def test_budget_of_a_model_that_embeds_counts_its_embedding_context(daemon: Daemon) -> None:
    """Its first embedding request creates the embedding context: still within 15 %."""
    status, r = daemon.json("POST", "/v1/completions", {
        "model": "gemma-embed", "prompt": "hello world, " * 160, "max_tokens": 8})
    assert status == 200, r
    status, r = daemon.json("POST", "/v1/embeddings", {
        "model": "gemma-embed", "input": ["edge boards run models. " * 80] * 2})
    assert status == 200, r
    m = daemon.health()["models"]["gemma-embed"]
    rss = _rss(int(m["runner_pid"]))
    ratio = m["budget_bytes"] / rss
    assert 0.85 <= ratio <= 1.15, (f"budget {m['budget_bytes'] >> 20} MiB, runner RSS "
                                   f"{rss >> 20} MiB, ratio {ratio:.3f}")
