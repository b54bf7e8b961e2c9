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

import hashlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import Daemon, launch, serve_argv
from journal_harness import journal_tokens, link_prepared, prompt_ids

from edge_agent.daemon.structured import call_key
from edge_agent.runtime.chat_template import GGUFChatTemplate

pytestmark = [pytest.mark.timeout(600)]

QWEN = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
THINKING = QWEN.parent / "thinking-fewshot.jinja"
QWEN3 = QWEN.parent / "Qwen-Qwen3-0.6B.jinja"
R1_LLAMA = QWEN.parent / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
R1_QWEN = QWEN.parent / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
LLAMA32 = QWEN.parent / "meta-llama-Llama-3.2-3B-Instruct.jinja"
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
    variables = root / "variables.jinja"  # what a request's chat_template_kwargs can make it do
    variables.write_text(
        "{%- if flavour == 'sour' %}{{ raise_exception('no sour flavour here') }}{% endif -%}\n"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor -%}\n"
        "{%- for i in range(echoes | default(0)) %}{{ echo }}{% endfor -%}\n"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}\n")
    cfg = _config(root, prepared_state_dir, model_path, "llamacpp",
                  {"qwenstyle": QWEN, "broken": broken, "thinker": THINKING, "qwen3": QWEN3,
                   "r1llama": R1_LLAMA, "r1qwen": R1_QWEN, "variables": variables,
                   "llama32": LLAMA32})
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


def test_a_native_call_streams_its_arguments_as_they_are_written(daemon: Daemon) -> None:
    """Under a template whose calls are <tool_call> blocks, a streamed call comes as OpenAI
    and llama-server stream one: its index, id, type and name first, then its arguments in
    parts; put together as the openai package does, it is the unstreamed reply."""
    from openai.lib.streaming._deltas import accumulate_delta

    ask = {"model": "qwenstyle", "messages": USER, "temperature": 0, "max_tokens": 60,
           "tools": [WEATHER], "tool_choice": "required"}
    whole = _chat(daemon, **ask)
    tokens = journal_tokens(daemon.journal)[whole["id"]]  # type: ignore[attr-defined]
    status, text = daemon.json("POST", "/detokenize", {"tokens": tokens, "model": "qwenstyle"})
    assert status == 200 and text["content"].startswith("<tool_call>"), text
    chunks = _sse(daemon, ask)
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks
             if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert len(calls) > 1, calls  # the arguments came in parts
    first = calls[0][0]
    assert (first["index"], first["type"], first["function"]["name"]) == (0, "function",
                                                                          "get_weather")
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
               for part in calls[1:] for d in part), calls  # then only arguments
    message: dict[Any, Any] = {}
    for c in chunks:
        message = accumulate_delta(message, c["choices"][0]["delta"])
    want = whole["choices"][0]["message"]["tool_calls"]
    assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [
        (c["type"], c["function"]) for c in want]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


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
    for think in (None, True, "low"):  # Ollama's levels are "on" for a model with none
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
    status, err = daemon.json("POST", "/api/chat", {**ask, "think": "max"})
    assert status == 400 and "field 'think': expected true, false or one of high, medium, " \
        'low, got "max"' in err["error"], err


def want_prompt_tokens(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens"])


def _prompt_text(d: Daemon, model: str, rid: str) -> str:
    """The prompt the journal holds for request `rid`, as text."""
    ids = prompt_ids(d.journal, rid)  # type: ignore[attr-defined]
    status, text = d.json("POST", "/detokenize", {"tokens": ids, "model": model})
    assert status == 200, text
    return str(text["content"])


def test_the_copied_templates_are_the_ones_the_manifest_names() -> None:
    manifest = json.loads((QWEN.parent / "MANIFEST.json").read_text())
    for name, entry in manifest["templates"].items():
        data = (QWEN.parent / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
THOUGHT = "The user wants the weather. I should call get_weather."


def test_a_thought_sent_back_is_rendered_where_the_template_renders_it(daemon: Daemon) -> None:
    """Qwen3's own template renders an assistant's reasoning_content in a tool-call loop (after
    the last user query). A call sent back as OpenAI clients send it (content null, arguments
    a JSON string) renders as llama-server renders it: content "", arguments as the object
    they encode, not a string of JSON."""
    said = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}
    tail = ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    ask = {"tools": [WEATHER], "max_tokens": 1}
    plain = _chat(daemon, "qwen3", messages=[*USER, said, result], **ask)
    text = _prompt_text(daemon, "qwen3", plain["id"])
    assert text.endswith("<|im_start|>assistant\n<tool_call>\n" + tail), text[-400:]
    thought = _chat(daemon, "qwen3", messages=[
        *USER, {**said, "reasoning_content": THOUGHT}, result], **ask)
    text = _prompt_text(daemon, "qwen3", thought["id"])
    assert text.endswith(f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n"
                         "<tool_call>\n" + tail), text[-400:]

    # Qwen2.5's template writes arguments with tojson only: a string would come out quoted
    reply = _chat(daemon, "qwenstyle", messages=[*USER, said, result], **ask)
    text = _prompt_text(daemon, "qwenstyle", reply["id"])
    assert text.endswith("<|im_start|>assistant\n<tool_call>\n" + tail), text[-400:]

    # Ollama's `thinking` is the same reasoning: the same prompt, token for token
    ollama = {"model": "qwen3", "stream": False, "tools": [WEATHER],
              "options": {"temperature": 0, "num_predict": 1}, "messages": [
                  *USER, {"role": "assistant", "content": "", "thinking": THOUGHT,
                          "tool_calls": [{"function": {"name": "get_weather",
                                                       "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "tool_name": "get_weather", "content": "18 degrees"}]}
    status, o = daemon.json("POST", "/api/chat", ollama)
    assert status == 200, o
    assert o["prompt_eval_count"] == thought["usage"]["prompt_tokens"], o
    assert o["prompt_eval_count"] > plain["usage"]["prompt_tokens"]

    # the reasoning is an assistant's, and text
    for body, where in (
            ({"messages": [{**USER[0], "reasoning_content": THOUGHT}]},
             "messages[0].reasoning_content"),
            ({"messages": [*USER, {**said, "reasoning_content": 5}, result]},
             "messages[1].reasoning_content")):
        status, err = daemon.json("POST", "/v1/chat/completions", {
            "model": "qwen3", "max_tokens": 1, **body})
        assert status == 400 and err["error"]["param"] == where, err
        assert "Hint:" in err["error"]["message"], err
    status, err = daemon.json("POST", "/api/chat", {
        **ollama, "messages": [{**USER[0], "thinking": THOUGHT}]})
    assert status == 400 and "messages[0].thinking" in err["error"], err


def test_a_template_that_writes_arguments_as_text_gets_the_text() -> None:
    """Which form a template takes a call's arguments in is found by rendering one, as
    llama.cpp finds it: an object for templates that write it with tojson, the JSON text for
    one that concatenates it (DeepSeek-R1-Distill-Llama's) or prints it as it is."""
    from edge_agent.daemon.structured import _object_arguments

    for path, objects in ((QWEN, True), (QWEN3, True), (R1_LLAMA, False), (R1_QWEN, True)):
        assert _object_arguments(GGUFChatTemplate(path.read_text())) is objects, path.name
    printed = GGUFChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                               "{{ c.function.arguments }}{% endfor %}{% endfor %}")
    assert not _object_arguments(printed)  # a dict printed is Python's repr, not JSON


def test_a_thought_the_generation_prompt_opens_is_reasoning(daemon: Daemon) -> None:
    """DeepSeek-R1-Distill-Llama's template opens the thought in the generation prompt, so the
    whole reply, until a </think>, is reasoning. The vendored R1-Distill-Qwen template closes
    it again unless enable_thinking is true: llama-server sets it true unless the request's
    chat_template_kwargs say otherwise, and so does the daemon."""
    ask = {"messages": SUM, "temperature": 0, "max_tokens": 6}
    for model in ("r1llama", "r1qwen"):
        raw = _chat(daemon, model, reasoning_format="none", **ask)
        assert _prompt_text(daemon, model, raw["id"]).endswith("<｜Assistant｜><think>\n")
        text = raw["choices"][0]["message"]["content"]
        assert "</think>" not in text, text  # six tokens: the thought is still open
        msg = _chat(daemon, model, **ask)["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == (text.strip(), ""), (model, msg)
    off = _chat(daemon, "r1qwen", chat_template_kwargs={"enable_thinking": False}, **ask)
    assert _prompt_text(daemon, "r1qwen", off["id"]).endswith("<｜Assistant｜><think>\n</think>")
    assert "reasoning_content" not in off["choices"][0]["message"], off


def test_template_variables_that_break_the_render_are_a_400_naming_them(daemon: Daemon) -> None:
    """A variable the template refuses (raise_exception) or that makes the rendering outgrow
    its bound is the request's fault: a 400 naming the variables, and the model serves on."""
    for kwargs, said in (({"flavour": "sour"}, "no sour flavour here"),
                         ({"echo": "x" * 40_000, "echoes": 64}, "rendering the chat template "
                          "stopped")):
        status, err = daemon.json("POST", "/v1/chat/completions", {
            "model": "variables", "messages": SUM, "max_tokens": 1,
            "chat_template_kwargs": kwargs})
        assert status == 400 and err["error"]["param"] == "messages", err
        message = err["error"]["message"]
        assert said in message and "Hint:" in message, message
        assert f"template variables {', '.join(sorted(kwargs))} the request set" in message
    reply = _chat(daemon, "variables", messages=SUM, chat_template_kwargs={
        "flavour": "sweet", "echo": "!", "echoes": 3})
    text = _prompt_text(daemon, "variables", reply["id"])
    assert text.endswith("What is 5+5?<|im_end|>\n!!!<|im_start|>assistant\n"), text


def test_a_template_that_asks_for_parameters_gets_a_call_with_parameters(daemon: Daemon) -> None:
    """Llama 3.x's templates tell the model to answer {"name", "parameters"}: a required call
    is decoded in that form (its grammar's key is the template's) and parsed as a call; the
    call sent back renders in the same form."""
    r = _chat(daemon, "llama32", tools=[WEATHER], tool_choice="required", max_tokens=40)
    assert r["choices"][0]["finish_reason"] == "tool_calls", r
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    tokens = journal_tokens(daemon.journal)[r["id"]]  # type: ignore[attr-defined]
    status, text = daemon.json("POST", "/detokenize", {"tokens": tokens, "model": "llama32"})
    assert status == 200 and text["content"].startswith('{"name": "get_weather", '
                                                        '"parameters": {"city": '), text
    said = {"role": "assistant", "content": None, "tool_calls": [call]}
    again = _chat(daemon, "llama32", messages=[*USER, said, {
        "role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}], tools=[WEATHER])
    prompt = _prompt_text(daemon, "llama32", again["id"])
    assert f'{{"name": "get_weather", "parameters": {call["function"]["arguments"]}}}' \
        in prompt, prompt[-300:]
    class Vocab:  # what call_key reads of a vocabulary
        def __init__(self, path: Path) -> None:
            self.chat_template = GGUFChatTemplate(path.read_text())

    assert [call_key(Vocab(p)) for p in (LLAMA32, QWEN, QWEN3, THINKING)] == [
        "parameters", "arguments", "arguments", "arguments"]
