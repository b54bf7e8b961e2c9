"""A chat request the model's own template refuses is the client's to fix: 400 naming the
field, on the OpenAI and Ollama routes, never a 503 that clients retry as a server fault.

The model is the default SmolLM2 GGUF given a template that refuses a system message the way
Mistral-style templates do (`raise_exception`), written with the `gguf` package's own
gguf-new-metadata; the daemon serves it on the llama.cpp engine, which renders the GGUF's
template.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import Daemon, launch, serve_argv

pytest.importorskip("llama_cpp", reason="the llama.cpp engine renders the GGUF's template")
pytest.importorskip("gguf", reason="gguf-new-metadata writes the test model")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STRICT = ("{% for m in messages %}{% if m['role'] == 'system' %}"
          "{{ raise_exception('System messages are not supported by this model') }}{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    from edge_agent.paths import default_model_path

    root = Path(tempfile.mkdtemp(prefix="ea-refuse-", dir="/tmp"))
    template = root / "strict.jinja"
    template.write_text(STRICT)
    model = root / "strict.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata",
                    "--chat-template-file", str(template), str(default_model_path()),
                    str(model)], check=True, capture_output=True, timeout=120)
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        '[runtime]\nengine = "llamacpp"\nmlock = "off"\nthreads = 1\n'
        f'[models.strict]\npath = "{model}"\ncontext = 256\nmax_batch = 2\npreload = true\n')
    with launch(Daemon, root, serve_argv(cfg)) as d:
        yield d


def test_openai_chat_refused_by_the_template_is_400_naming_messages(daemon: Daemon) -> None:
    status, r = daemon.json("POST", "/v1/chat/completions",
                            {"model": "strict", "messages": TURNS, "max_tokens": 2})
    assert status == 400, r
    err = r["error"]
    assert (err["code"], err["param"]) == ("invalid_request", "messages")
    assert "System messages are not supported by this model" in err["message"]
    assert "Hint:" in err["message"]
    # the same conversation without the system turn serves: the daemon was never at fault
    status, r = daemon.json("POST", "/v1/chat/completions",
                            {"model": "strict", "messages": TURNS[1:], "max_tokens": 2})
    assert status == 200, r


def test_ollama_routes_refused_by_the_template_are_400_naming_their_field(
        daemon: Daemon) -> None:
    status, r = daemon.json("POST", "/api/chat",
                            {"model": "strict", "messages": TURNS, "stream": False})
    assert status == 400 and "System messages are not supported" in r["error"], r
    # /api/generate makes chat turns of "system" and "prompt": the error names the prompt
    status, r = daemon.json("POST", "/api/generate", {
        "model": "strict", "system": "Be brief.", "prompt": "Hi", "stream": False})
    assert status == 400, r
    assert r["error"].startswith("field 'prompt': ") and "messages" not in r["error"][:20], r
    status, r = daemon.json("POST", "/api/generate",
                            {"model": "strict", "prompt": "Hi", "stream": False,
                             "options": {"num_predict": 2}})
    assert status == 200, r
