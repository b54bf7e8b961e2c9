"""`models.NAME.chat_template_file`: a Jinja chat template rendered instead of the GGUF's own,
and a thinking model's reasoning kept apart from its answer.

The real SmolLM2 GGUF served twice by one daemon on the llama.cpp engine: as itself, and under
Qwen2.5's template (tests/data/templates, a ChatML template that renders tools natively, whose
markers are SmolLM2's own special tokens). The second one's prompts are that template's
rendering token for token, `/api/show` shows it, a required tool call takes the native
`<tool_call>` form and a session's tool result is rendered as that template renders it. A
template file that does not compile fails its model's load naming the file while the others
serve; the numpy engine refuses the key naming it. Under a thinking template
(tests/data/templates/thinking-fewshot.jinja: worked examples, the thought opened by the
generation prompt) SmolLM2 writes a thought, `</think>` and an answer: OpenAI's
`reasoning_content` and Ollama's `thinking` hold the thought, streamed or not, and
`reasoning_format: "none"` or a model that does not think leave the text as it was written.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import Daemon, launch, serve_argv
from journal_harness import link_prepared, prompt_ids

from edge_agent.runtime.chat_template import GGUFChatTemplate

pytestmark = [pytest.mark.timeout(600)]

QWEN = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
THINKING = QWEN.parent / "thinking-fewshot.jinja"
SUM = [{"role": "user", "content": "What is 5+5?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _config(root: Path, state: Path, model: Path, engine: str, models: dict[str, Path]) -> Path:
    text = (f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{state}"\n'
            "drain_timeout_s = 5\n"
            f'[runtime]\nengine = "{engine}"\nmlock = "off"\nthreads = 1\n'
            "[models.smollm2]\ncontext = 1024\nmax_batch = 2\npreload = true\n")
    for name, template in models.items():
        text += (f'[models.{name}]\npath = "{model}"\ncontext = 1024\nmax_batch = 2\n'
                 f'chat_template_file = "{template}"\n')
    cfg = root / "config.toml"
    cfg.write_text(text)
    return cfg


@pytest.fixture(scope="module")
def daemon(prepared_state_dir: Path, model_path: Path) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-tf-", dir="/tmp"))
    broken = root / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message.content }")
    cfg = _config(root, prepared_state_dir, model_path, "llamacpp",
                  {"qwenstyle": QWEN, "broken": broken, "thinker": THINKING})
    with launch(Daemon, root, serve_argv(cfg)) as d:
        d.broken = broken  # type: ignore[attr-defined]
        d.journal = prepared_state_dir / "journal.sqlite3"  # type: ignore[attr-defined]
        yield d


def _chat(d: Daemon, model: str, **body: Any) -> dict[str, Any]:
    status, reply = d.json("POST", "/v1/chat/completions", {
        "model": model, "temperature": 0, "max_tokens": 1, "messages": USER, **body})
    assert status == 200, reply
    return dict(reply)


def test_the_prompt_is_the_template_files_rendering(daemon: Daemon) -> None:
    rendered = GGUFChatTemplate(QWEN.read_text()).render(USER)
    assert rendered.startswith("<|im_start|>system\nYou are Qwen")
    status, ids = daemon.json("POST", "/tokenize", {"content": rendered, "model": "qwenstyle"})
    assert status == 200, ids
    reply = _chat(daemon, "qwenstyle")
    assert prompt_ids(daemon.journal, reply["id"]) == ids["tokens"]  # type: ignore[attr-defined]
    own = _chat(daemon, "smollm2")  # the same GGUF under its own template: another prompt
    assert own["usage"]["prompt_tokens"] != len(ids["tokens"])
    status, show = daemon.json("POST", "/api/show", {"model": "qwenstyle"})
    assert status == 200 and show["template"] == QWEN.read_text(), show.get("template")
    status, show = daemon.json("POST", "/api/show", {"model": "smollm2"})
    assert status == 200 and "You are Qwen" not in show["template"]


def test_a_template_that_renders_tools_gets_native_calls_in_a_session(daemon: Daemon) -> None:
    """The template lists the tools itself and speaks of <tool_call>: the required call is
    decoded in that form and parsed; the next turn of the session sends only the result,
    which the template renders as a <tool_response> after the model's own call."""
    journal: Path = daemon.journal  # type: ignore[attr-defined]
    ask = {"tools": [WEATHER], "session": "qwen-tools", "max_tokens": 60}
    r1 = _chat(daemon, "qwenstyle", tool_choice="required", **ask)
    assert r1["choices"][0]["finish_reason"] == "tool_calls", r1
    call = r1["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    p1 = prompt_ids(journal, r1["id"])
    status, text = daemon.json("POST", "/detokenize", {"tokens": p1, "model": "qwenstyle"})
    assert status == 200 and "<tools>\n" + json.dumps(WEATHER) in text["content"], text

    result = {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}
    r2 = _chat(daemon, "qwenstyle", messages=[result], tool_choice="none", **ask)
    p2 = prompt_ids(journal, r2["id"])
    assert p2[:len(p1)] == p1
    status, turn = daemon.json("POST", "/detokenize", {"tokens": p2[len(p1):],
                                                       "model": "qwenstyle"})
    assert status == 200, turn
    assert turn["content"].startswith("<tool_call>"), turn  # the model's own call, kept
    assert turn["content"].endswith("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>"
                                    "\n18 degrees\n</tool_response><|im_end|>\n"
                                    "<|im_start|>assistant\n"), turn


def test_a_template_file_that_does_not_compile_fails_its_model_only(daemon: Daemon) -> None:
    broken: Path = daemon.broken  # type: ignore[attr-defined]
    status, err = daemon.json("POST", "/v1/chat/completions", {
        "model": "broken", "messages": USER, "max_tokens": 1})
    assert status == 503 and err["error"]["code"] == "model_failed", err
    message = err["error"]["message"]
    assert str(broken) in message and "Hint:" in message, message
    health = daemon.health()
    assert health["models"]["broken"]["state"] == "failed", health["models"]["broken"]
    assert str(broken) in health["models"]["broken"]["reason"]
    assert _chat(daemon, "qwenstyle")["choices"][0]["finish_reason"] == "length"


def test_the_numpy_engine_refuses_the_key(prepared_state_dir: Path, model_path: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="ea-tfn-", dir="/tmp"))
    link_prepared(prepared_state_dir, root / "state")  # its own state: the module's daemon runs
    cfg = _config(root, root / "state", model_path, "numpy", {"qwenstyle": QWEN})
    with launch(Daemon, root, serve_argv(cfg)) as d:
        status, err = d.json("POST", "/v1/chat/completions", {
            "model": "qwenstyle", "messages": USER, "max_tokens": 1})
        assert status == 503 and err["error"]["code"] == "model_failed", err
        message = err["error"]["message"]
        assert "models.qwenstyle.chat_template_file: the numpy engine renders ChatML itself" \
            in message and 'runtime.engine = "llamacpp"' in message, message
        assert _chat(d, "smollm2")["choices"][0]["finish_reason"] == "length"


def _sse(d: Daemon, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, _, data = d.call("POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200, data
    events = [line[len(b"data: "):] for line in data.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_a_thinking_models_reasoning_is_kept_apart_from_its_answer(daemon: Daemon) -> None:
    ask = {"model": "thinker", "messages": SUM, "temperature": 0, "max_tokens": 40}
    status, raw = daemon.json("POST", "/v1/chat/completions", {**ask,
                                                               "reasoning_format": "none"})
    assert status == 200, raw
    text = raw["choices"][0]["message"]["content"]
    assert "reasoning_content" not in raw["choices"][0]["message"]
    assert "</think>" in text, text  # the model closed its thought, as the examples do
    before, after = text.split("</think>", 1)
    status, r = daemon.json("POST", "/v1/chat/completions", ask)
    assert status == 200, r
    msg = r["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (before.strip(), after.lstrip()), msg
    assert msg["reasoning_content"] and msg["content"]
    assert [r["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == [
        raw["usage"][k] for k in ("prompt_tokens", "completion_tokens")]

    events = _sse(daemon, {**ask, "logprobs": True})
    deltas = [e["choices"][0]["delta"] for e in events]
    entries = [x for e in events for x in (e["choices"][0].get("logprobs") or {}).get(
        "content") or ()]
    assert len(entries) == raw["usage"]["completion_tokens"]  # each token's, once, in order
    said = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    answered = [d["content"] for d in deltas if "content" in d]
    assert "".join(said) == msg["reasoning_content"] and "".join(answered) == msg["content"]
    assert len(said) > 1, said  # the thought streamed as it came
    last_thought = max(i for i, d in enumerate(deltas) if "reasoning_content" in d)
    assert all("content" not in d for d in deltas[:last_thought + 1])

    # a model whose template does not think keeps its text, whatever it writes
    status, own = daemon.json("POST", "/v1/chat/completions", {**ask, "model": "smollm2"})
    assert status == 200 and "reasoning_content" not in own["choices"][0]["message"], own


def test_ollama_think_shows_hides_or_turns_off_the_thought(daemon: Daemon) -> None:
    status, r = daemon.json("POST", "/v1/chat/completions", {
        "model": "thinker", "messages": SUM, "temperature": 0, "max_tokens": 40})
    assert status == 200, r
    want = r["choices"][0]["message"]
    ask = {"model": "thinker", "messages": SUM, "stream": False,
           "options": {"temperature": 0, "num_predict": 40}}
    for think in (None, True):
        status, o = daemon.json("POST", "/api/chat", {**ask, **(
            {} if think is None else {"think": think})})
        assert status == 200, o
        assert (o["message"]["thinking"], o["message"]["content"]) == (
            want["reasoning_content"], want["content"]), o
    status, _, data = daemon.call("POST", "/api/chat", {**ask, "stream": True, "think": True})
    assert status == 200, data
    objs = [json.loads(line) for line in data.splitlines() if line.strip()]
    assert "".join(o["message"].get("thinking", "") for o in objs) == want["reasoning_content"]
    assert "".join(o["message"]["content"] for o in objs) == want["content"]
    status, show = daemon.json("POST", "/api/show", {"model": "thinker"})
    assert status == 200 and show["capabilities"] == ["completion", "tools", "thinking"], show
    status, g = daemon.json("POST", "/api/generate", {
        "model": "thinker", "prompt": SUM[0]["content"], "stream": False,
        "options": {"temperature": 0, "num_predict": 40}})
    assert status == 200 and g["thinking"] == want["reasoning_content"], g
    assert g["response"] == want["content"]

    # think: false closes the thought in the prompt (the template's enable_thinking)
    status, off = daemon.json("POST", "/api/chat", {**ask, "think": False})
    assert status == 200 and "thinking" not in off["message"], off
    assert off["prompt_eval_count"] > want_prompt_tokens(r)
    # think: true for a model that does not think is a 400 naming think
    status, err = daemon.json("POST", "/api/chat", {**ask, "model": "smollm2", "think": True})
    assert status == 400 and "field 'think': model 'smollm2' does not think" in err["error"], err
    status, err = daemon.json("POST", "/api/chat", {**ask, "think": "high"})
    assert status == 400 and "field 'think': expected true or false" in err["error"], err


def want_prompt_tokens(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens"])
