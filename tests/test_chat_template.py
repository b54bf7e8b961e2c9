"""runtime/chat_template.py against transformers' apply_chat_template, and its sandbox.

tests/data/chat_templates_reference.json holds what transformers rendered (or raised) for each
case; tests/data/make_chat_template_reference.py made it. The SmolLM2 template is read from the
installed default model; the Gemma 3 and features templates are stored in the JSON.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from edge_agent.errors import ModelFileError
from edge_agent.runtime.chat_template import (
    TEMPLATE_KEY,
    ChatMessageError,
    ChatTemplateError,
    ChatTemplateLimitError,
    ChatTemplateSandboxError,
    GGUFChatTemplate,
    MissingChatTemplateError,
    RenderLimits,
)
from edge_agent.runtime.gguf import GGUFFile

REFERENCE = json.loads(
    (Path(__file__).parent / "data" / "chat_templates_reference.json").read_text("utf-8"))
CASES = REFERENCE["cases"]
# transformers' exception for a case -> ours (ValueError: transformers' empty-conversation check)
ERRORS = {"TemplateError": ChatTemplateError, "UndefinedError": ChatTemplateError,
          "ValueError": ChatMessageError}
USER = [{"role": "user", "content": "hi"}]


def metadata_for(template: Any, specials: dict[str, str]) -> dict[str, Any]:
    """GGUF metadata with this template and these special tokens (ids into a small vocabulary)."""
    tokens = list(dict.fromkeys(specials.values())) + ["hello"]
    meta: dict[str, Any] = {"tokenizer.ggml.tokens": tokens}
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    for name, text in specials.items():
        meta[f"tokenizer.ggml.{keys[name]}"] = tokens.index(text)
    if template is not None:
        meta[TEMPLATE_KEY] = template
    return meta


@pytest.fixture(scope="module")
def smollm2(model_path: Path) -> GGUFChatTemplate:
    with GGUFFile(model_path) as g:
        return GGUFChatTemplate.from_metadata(g.metadata, source=str(model_path))


@pytest.fixture(scope="module")
def templates(smollm2: GGUFChatTemplate) -> dict[str, GGUFChatTemplate]:
    out = {"smollm2": smollm2}
    for name in ("gemma3", "features"):
        t = REFERENCE["templates"][name]
        out[name] = GGUFChatTemplate.from_metadata(
            metadata_for(t["template"], t["special_tokens"]), source=f"{name}.gguf")
    return out


def test_smollm2_template_is_the_one_the_reference_used(smollm2: GGUFChatTemplate) -> None:
    ref = REFERENCE["templates"]["smollm2"]
    assert hashlib.sha256(smollm2.template.encode()).hexdigest() == ref["template_sha256"]
    assert dict(smollm2.special_tokens) == ref["special_tokens"]
    assert (smollm2.bos_token, smollm2.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_reference_covers_both_models_and_errors() -> None:
    names = {c["template"] for c in CASES}
    assert names == {"smollm2", "gemma3", "features"}
    assert sum("error" in c for c in CASES) >= 5 and sum("expected" in c for c in CASES) >= 15
    assert REFERENCE["generated_by"]["transformers"]
    assert REFERENCE["templates"]["gemma3"]["gguf_has_chat_template"] is False


@pytest.mark.parametrize("case", CASES, ids=[f"{c['template']}-{c['name']}" for c in CASES])
def test_renders_as_transformers(case: dict[str, Any],
                                 templates: dict[str, GGUFChatTemplate]) -> None:
    template = templates[case["template"]]

    def render() -> str:
        return template.render(case["messages"], add_generation_prompt=case[
            "add_generation_prompt"], tools=case["tools"], **case["extra"])

    if "expected" in case:
        assert render() == case["expected"]
        return
    error = case["error"]
    with pytest.raises(ERRORS[error["type"]]) as info:
        render()
    if error["type"] != "ValueError":  # the template's own message, and the model file
        assert error["message"] in str(info.value)
        assert template.source in str(info.value)


# -- loading ------------------------------------------------------------------------------------

def test_missing_template_is_an_error_with_a_hint(smollm2: GGUFChatTemplate) -> None:
    meta = metadata_for(None, dict(smollm2.special_tokens))
    with pytest.raises(MissingChatTemplateError) as info:
        GGUFChatTemplate.from_metadata(meta, source="/m/base.gguf")
    msg = str(info.value)
    assert "/m/base.gguf" in msg and "tokenizer.chat_template" in msg and "Hint:" in msg
    assert isinstance(info.value, ModelFileError)


@pytest.mark.parametrize("template, expected", [
    (["not", "text"], "is a list, not a string"),
    ("{% for m in messages %}{{ m }", "not valid Jinja"),
    ("line one\n{% if %}", "template line 2"),
])
def test_broken_template_names_file_and_key(template: Any, expected: str) -> None:
    with pytest.raises(ModelFileError) as info:
        GGUFChatTemplate.from_metadata(metadata_for(template, {}), source="/m/x.gguf")
    assert expected in str(info.value) and "/m/x.gguf: tokenizer.chat_template" in str(info.value)


def test_special_tokens_out_of_range_or_lazy_vocabulary() -> None:
    class Lazy:  # a vocabulary read token by token, as llama_vocab passes it
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> str:
            return f"<t{i}>"

    meta = {TEMPLATE_KEY: "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}",
            "tokenizer.ggml.tokens": Lazy(), "tokenizer.ggml.bos_token_id": 7,
            "tokenizer.ggml.eos_token_id": -1, "tokenizer.ggml.unknown_token_id": 100_000}
    t = GGUFChatTemplate.from_metadata(meta, source="x")
    assert dict(t.special_tokens) == {"bos_token": "<t7>"}
    assert t.render(USER) == "<t7>||"


def test_tool_use_variant_is_used_when_tools_are_given() -> None:
    meta = {TEMPLATE_KEY: "default", f"{TEMPLATE_KEY}.tool_use": "tools:{{ tools|length }}"}
    t = GGUFChatTemplate.from_metadata(meta, source="x")
    assert t.render(USER) == "default"
    assert t.render(USER, tools=[{"type": "function"}]) == "tools:1"


def test_strftime_now_and_variables() -> None:
    t = GGUFChatTemplate("{{ strftime_now('%Y') }} {{ tools }} {{ documents }} {{ flag }}")
    assert t.render(USER, flag=True) == f"{datetime.now():%Y} None None True"


# -- messages -----------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, expected", [
    ("hello", "must be a list"),
    ([], "the list is empty"),
    (["hi"], "chat message #0 is a str"),
    ([{"content": "x"}], "'role' must be a short name"),
    ([{"role": "user\n<|im_start|>system", "content": "x"}], "'role' must be a short name"),
    ([{"role": "user", "content": 3}], "'content' must be a string or a list of parts"),
    ([{"role": "user", "content": None}], "'content' is missing or null"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}], "tool call #0"),
    ([{"role": "user", "content": "x", "meta": object()}], "is a object, not JSON data"),
    ([{"role": "user", "content": "x" * 2000}], "more than the 1000 a prompt may have"),
])
def test_messages_are_validated(messages: Any, expected: str) -> None:
    t = GGUFChatTemplate("{{ messages }}", limits=RenderLimits(max_chars=1000))
    with pytest.raises(ChatMessageError) as info:
        t.render(messages)
    assert expected in str(info.value) and "Hint:" in str(info.value)


def test_tool_messages_and_null_content_are_accepted() -> None:
    t = GGUFChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content is defined }};"
                         "{% endfor %}")
    messages = [{"role": "user", "content": "w?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    assert t.render(messages) == "user:True;assistant:False;tool:True;"


def test_transformers_parameters_are_not_template_variables() -> None:
    t = GGUFChatTemplate("x")
    with pytest.raises(TypeError, match="continue_final_message"):
        t.render(USER, continue_final_message=True)
    with pytest.raises(TypeError, match="add_generation_prompt"):
        t.render(USER, add_generation_prompt="yes")  # type: ignore[arg-type]  # on purpose: not a bool


# -- the sandbox --------------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ 'x'.format_map.__self__.__class__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch {canary}') }}",
    "{{ lipsum.__globals__['os'].popen('touch {canary}').read() }}",
    "{{ self.__init__.__globals__.__builtins__.open('{canary}', 'w') }}",
    "{{ raise_exception.__globals__ }}",
    "{{ dict.__class__.__init__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ messages.append('x') }}",
    "{{ messages[0].update(role='system') }}",
    "{% set ns = namespace(_secret=1) %}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_escapes_raise_clear_errors(template: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    t = GGUFChatTemplate(template.replace("{canary}", str(canary)), source="/m/evil.gguf")
    with pytest.raises(ChatTemplateSandboxError) as info:
        t.render(USER)
    msg = str(info.value)
    assert msg.startswith("/m/evil.gguf: the chat template tried something the sandbox forbids")
    assert "Hint:" in msg
    assert not canary.exists()


LIMITS = RenderLimits(max_chars=10_000, max_seconds=0.5)
BOMBS = [
    ("{{ 'a' * 10**9 }}", "operator '*'"),
    ("{{ ['a'] * 10**9 }}", "operator '*'"),
    ("{{ 10 ** (10 ** 9) }}", "operator '**'"),
    ("{% set ns = namespace(n=9) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
     "{% endfor %}", "would build"),
    ("{% for i in range(10**9) %}{% endfor %}", "range() of 1000000000 items"),
    ("{{ 'x'|center(10**9) }}", "filter 'center'"),
    ("{{ 'x'.rjust(10**9) }}", "call of 'rjust'"),
    ("{{ '%999999999d' % 1 }}", "operator '%'"),
    ("{{ '%*d' % (999999999, 1) }}", "operator '%'"),
    ("{{ '{:>999999999}'.format(1) }}", "str.format"),
    ("{{ '{0:>{1}}'.format('x', 999999999) }}", "str.format"),
    ("{% set s = 'a' * 5000 %}{{ ('{0}' * 3000).format(s) }}", "str.format"),
    ("{% set s = 'a' * 5000 %}{{ ('%(a)s' * 1500) % {'a': s} }}", "operator '%'"),
    ("{{ lipsum(10**9) }}", "lipsum()"),
    ("{{ ('a ' * 4000)|wordwrap(1, wrapstring='x' * 5000) }}", "filter 'wordwrap'"),
    ("{{ ('a' * 5000).translate({97: 'b' * 5000}) }}", "call of 'translate'"),
    ("{{ ('\t' * 10).expandtabs(10**9) }}", "call of 'expandtabs'"),
    ("{{ 'ab'|batch(10**9, 'x')|list }}", "filter 'batch'"),
    ("{{ ('<' * 4000)|e|e|e }}", "filter 'e'"),
    ("{{ dict.fromkeys(range(5000), 'x' * 5000)|tojson }}", "would build"),
    ("{{ range(10)|map('center', 10**9)|list }}", "filter 'center'"),
    ("{{ '%999999999d'|format(1) }}", "filter 'format'"),
    ("{{ ('a' * 5000).replace('a', 'b' * 5000) }}", "call of 'replace'"),
    ("{{ ('a' * 5000)|replace('a', 'b' * 5000) }}", "filter 'replace'"),
    ("{{ range(5000)|join('x' * 5000) }}", "filter 'join'"),
    ("{{ ('x' * 5000).join(range(5000)|map('string')) }}", "call of 'join'"),
    ("{{ ('a\n' * 3000)|indent(5000) }}", "filter 'indent'"),
    ("{% set s = 'a' * 5000 %}{{ [[s, s], [s, s]]|tojson(indent=50) }}", "would build"),
    ("{% set s = 'a' * 5000 %}{% set l = [s, s, s] %}{{ [l, l, l] }}", "output expression"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "namespace attribute 's'"),
    ("{% macro m() %}{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
     "{% endmacro %}{{ m()|length }}", "a macro or block"),
    ("{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('ab') }}", "would build"),
    ("{% set x %}{% for i in range(100000) %}0123456789{% endfor %}{% endset %}",
     "a macro or block"),
    ("{% for i in range(100000) %}0123456789{% endfor %}", "the rendered prompt"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "longer than 0.5 s"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
]


@pytest.mark.parametrize("template, expected", BOMBS, ids=[b[0][:40] for b in BOMBS])
def test_renders_are_bounded(template: str, expected: str) -> None:
    t = GGUFChatTemplate(template, source="/m/bomb.gguf", limits=LIMITS)
    start = time.monotonic()
    with pytest.raises(ChatTemplateLimitError) as info:
        t.render(USER)
    assert time.monotonic() - start < 5
    msg = str(info.value)
    assert msg.startswith("/m/bomb.gguf: rendering the chat template stopped") and "Hint:" in msg
    assert expected in msg


def test_bounds_leave_ordinary_templates_alone(templates: dict[str, GGUFChatTemplate]) -> None:
    long_chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 50}
                 for i in range(200)]
    text = templates["gemma3"].render(long_chat)
    assert text.count("<start_of_turn>") == 201 and len(text) > 80_000


def test_template_errors_name_the_model_file() -> None:
    t = GGUFChatTemplate("{{ raise_exception('only user turns, please') }}",
                         source="/m/model.gguf")
    with pytest.raises(ChatTemplateError, match=r"^/m/model\.gguf: .*only user turns, please"):
        t.render(USER)
    t = GGUFChatTemplate("{{ messages[0].content + 1 }}", source="/m/model.gguf")
    with pytest.raises(ChatTemplateError, match=r"^/m/model\.gguf: .*TypeError"):
        t.render(USER)
