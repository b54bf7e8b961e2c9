"""Structured output: `response_format` and `tools` as a grammar, a prompt and parsed tool calls.

Invariants owned here:
- A request gets a grammar (runtime/constrain.py, sent to the runner with its sampling
  parameters and journaled with them) only for `response_format` json_object / json_schema or
  `tool_choice` "required" / a named function; every other request is decoded unconstrained.
- A required call's grammar writes its arguments under the key the model's template writes
  a call sent back under (`call_key`: "parameters" for Llama 3.x's, else "arguments").
- A grammar is checked before the request is accepted: a schema the library cannot compile is
  an `InvalidRequest` (edge_agent/errors.py; HTTP 400 `invalid_request`) naming
  `response_format` (or the tool) and the library's reason.
- Tools reach the model through its chat template when the template renders them (the output
  form is then `<tool_call>{json}</tool_call>` if the template speaks of it, else a bare JSON
  object); a template that ignores them (SmolLM2's, Gemma 3's, the numpy engine's ChatML) gets
  TOOLS_PROMPT as a system message, assistant tool calls as their JSON text and tool results
  as user messages (docs/api.md). A template that renders tools gets a call sent back as
  llama-server gives it: content "" for null, its arguments the object they encode when the
  template writes objects (`_object_arguments`, probed once per template), else their text.
- Every Jinja template gets `enable_thinking` true unless the request sets it (llama-server's
  default), and an assistant's reasoning sent back as the message's `reasoning_content`.
- `parse_tool_calls` recognizes `<tool_call>{json}</tool_call>` blocks, or a reply that is one
  JSON object {"name": NAME, "arguments": {...}} ("parameters" for "arguments", as Llama 3.x
  writes it; a ```json fence around it allowed), NAME one of the request's functions;
  anything else is text. A reply with blocks keeps the text before the first as its content
  (`call_content`).
- A stream of a reply that may call tools (`CallGate`) sends as text what can no longer be part
  of a call, as it comes: the text before a `<tool_call>` (or before a tail that could begin
  one), without its trailing whitespace; a reply whose first non-blank character is `{` or a
  backtick (a bare or fenced JSON call) is held whole. The rest is known at the end: the calls
  and, if none, the text held back. What a stream sends is what the unstreamed reply says.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from edge_agent.errors import InvalidRequest
from edge_agent.protocol.api import GenerationRequest

__all__ = ["TOOLS_PROMPT", "CallGate", "call_content", "call_names", "chat_prompt",
           "grammar_for", "held_tail", "jinja_template", "may_call_tools", "parse_tool_calls",
           "reply_content", "template_messages", "tool_calls", "tools_key"]

TOOLS_PROMPT = (
    "You can call functions. These are the functions, with the JSON Schema of their "
    "arguments:\n{listing}\nTo call a function, reply with only a JSON object: "
    '{{"name": "<function name>", "arguments": {{<its arguments>}}}}. {rule}'
)
_RULE = {"auto": "Otherwise answer in plain text.", "required": "You must call a function.",
         "named": "You must call {name}."}
_MARK = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@functools.lru_cache(maxsize=64)
def _checked(grammar: str) -> str | None:
    from edge_agent.runtime.constrain import check_grammar  # llguidance: on first use

    return check_grammar(grammar)


def _offered(req: GenerationRequest) -> list[dict[str, Any]]:
    """The functions offered to the model (none with tool_choice "none")."""
    if not req.tools or req.tool_choice == "none":
        return []
    return [t["function"] for t in req.tools]


def jinja_template(tok: Any) -> Any:
    """The model's Jinja chat template (`GGUFChatTemplate`: it takes template variables), or
    None: no template, or the numpy engine's ChatML."""
    from edge_agent.runtime.chat_template import GGUFChatTemplate  # loaded with the vocab

    template = tok.chat_template
    return template if isinstance(template, GGUFChatTemplate) else None


def held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (a stream holds
    them until the next piece says)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:k])), 0)


def _native(tok: Any) -> tuple[bool, bool]:
    """(the chat template renders tools, its calls are <tool_call> blocks)."""
    template = jinja_template(tok)
    if template is None:
        return False, False  # none, or the numpy engine's ChatML: tools go in a system message
    render = template.render
    probe = [{"role": "user", "content": "x"}]
    tool = [{"type": "function", "function": {"name": "probe", "parameters": {}}}]
    try:
        native = render(probe, tools=tool) != render(probe)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False, False
    source = (template.tool_use_template or "") + template.template
    return native, native and "<tool_call>" in source


def grammar_for(req: GenerationRequest, tok: Any) -> str | None:
    """The grammar the output must follow (None: unconstrained); InvalidRequest naming the
    field ("field 'x': ...") when it cannot be used."""
    choice = req.tool_choice
    functions = _offered(req)
    if not (functions and choice != "auto") and req.response_format is None:
        return None
    # llguidance loads on the first constrained request, not at every start or request
    from edge_agent.runtime.constrain import json_grammar, tool_call_grammar

    if functions and choice != "auto":
        if req.response_format is not None:
            raise InvalidRequest("field 'response_format': cannot be combined with "
                                 f"tool_choice {json.dumps(choice)} (the reply is a tool "
                                 "call). Hint: drop response_format, or use tool_choice "
                                 '"auto".')
        if isinstance(choice, dict):
            functions = [f for f in functions if f["name"] == choice["function"]["name"]]
        grammar = tool_call_grammar(functions, tags=_native(tok)[1], key=call_key(tok))
        field, what = "tools", "a function's parameters"
    elif req.response_format is not None:
        fmt = req.response_format
        schema = fmt["json_schema"]["schema"] if fmt["type"] == "json_schema" else None
        grammar = json_grammar(schema)
        field, what = "response_format", "the JSON schema"
    else:
        return None
    err = _checked(grammar)
    if err is not None:
        raise InvalidRequest(f"field {field!r}: {what} cannot be used for constrained "
                             f"decoding: {err}. Hint: fix the schema; docs/api.md lists the "
                             "JSON Schema keywords supported.")
    return grammar


def _arguments(fn: dict[str, Any]) -> Any:
    """A call's arguments as the JSON value their text encodes (as sent, when it does not)."""
    try:
        return json.loads(fn["arguments"])
    except ValueError:
        return fn["arguments"]


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    return json.dumps({"name": fn["name"], "arguments": _arguments(fn)}, ensure_ascii=False)


_PROBE_VALUE = "edge-agent-probe-value"
_PROBES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _probe(template: Any) -> str:
    """`template`'s rendering of a call sent back with its arguments as an object ("": it
    cannot render one), once per template: how llama.cpp finds what a template takes."""
    text = _PROBES.get(template)
    if text is None:
        call = {"id": "call00001", "type": "function",
                "function": {"name": "tool1", "arguments": {"arg": _PROBE_VALUE}}}
        probe = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call00001", "content": "y"}]
        tool = [{"type": "function", "function": {"name": "tool1", "parameters": {
            "type": "object", "properties": {"arg": {"type": "string"}}}}}]
        try:
            text = str(template.render(probe, tools=tool))
        except Exception:  # noqa: BLE001 - it cannot take objects: the JSON text, as sent
            text = ""
        _PROBES[template] = text
    return text


def _object_arguments(template: Any) -> bool:
    """Whether `template` writes a call's arguments given as an object, as JSON (most do, with
    `tojson`, as transformers documents); False: it needs their JSON text (it concatenates
    them)."""
    return re.search(r'"arg":\s*"' + _PROBE_VALUE, _probe(template)) is not None


def call_key(tok: Any) -> str:
    """The key a model's template writes a call's arguments under: "parameters" for one that
    writes {"name", "parameters"} (Llama 3.x's), else "arguments"."""
    template = jinja_template(tok)
    if template is None or not re.search(r'"parameters":\s*\{\s*"arg":\s*"' + _PROBE_VALUE,
                                         _probe(template)):
        return "arguments"
    return "parameters"


def _template_call(call: dict[str, Any], objects: bool) -> dict[str, Any]:
    """A call sent back, for a template that renders calls: its arguments as the object they
    encode when the template takes objects (`_object_arguments`), else as sent."""
    fn = call["function"]
    return {**call, "function": {**fn, "arguments": _arguments(fn) if objects
                                 else fn["arguments"]}}


def chat_prompt(req: GenerationRequest, tok: Any) -> list[int]:
    """The prompt ids of a chat request, tools and tool messages included."""
    msgs, extra = template_messages(req, tok)
    return list(tok.apply_chat_template(msgs, **extra))


def template_messages(req: GenerationRequest, tok: Any, *,
                      names: Mapping[str, str] | None = None, listing: bool = True
                      ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, keyword arguments) to render `req`'s chat with the model's template, tools and
    tool messages included. `names`: call id -> function of calls made before these messages
    (a session's earlier turns; the messages' own calls are added); `listing`: a template that
    does not render tools gets the TOOLS_PROMPT system message (a session's later turns have
    it in their history already)."""
    assert req.messages is not None
    functions = _offered(req)
    native, _ = _native(tok) if (functions or _has_tool_turns(req)) else (False, False)
    jinja = jinja_template(tok) is not None
    # llama-server's variables: enable_thinking true unless the request says otherwise
    variables = {"enable_thinking": True, **(req.template_vars or {})} if jinja else {}
    if native:
        objects = any(m.tool_calls for m in req.messages) and _object_arguments(
            jinja_template(tok))
        msgs = []
        for m in req.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:  # as llama-server gives them: content "", arguments an object
                d["tool_calls"] = [_template_call(c, objects) for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.reasoning is not None and jinja:
                d["reasoning_content"] = m.reasoning
            msgs.append(d)
        tools = [{"type": "function", "function": f} for f in functions] or None
        return msgs, {**variables, "tools": tools}
    called = {**(names or {}), **{c["id"]: c["function"]["name"] for m in req.messages
                                  for c in m.tool_calls or ()}}
    msgs = []
    for m in req.messages:
        if m.role == "tool":
            who = called.get(m.tool_call_id or "", "the function")
            call = f" (call {m.tool_call_id})" if m.tool_call_id else ""  # None: answers no call
            msgs.append({"role": "user", "content": f"Result of {who}{call}: {m.content}"})
        elif m.tool_calls:
            text = "\n".join(_call_text(c) for c in m.tool_calls)
            msgs.append({"role": m.role, "content": f"{m.content}\n{text}" if m.content
                         else text})
        else:
            msgs.append({"role": m.role, "content": m.content})
        if m.reasoning is not None and jinja and m.role == "assistant":
            msgs[-1]["reasoning_content"] = m.reasoning
    if functions and listing:
        choice = req.tool_choice
        rule = (_RULE["named"].format(name=choice["function"]["name"])
                if isinstance(choice, dict) else _RULE[str(choice)])
        listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        text = TOOLS_PROMPT.format(listing=listed, rule=rule)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": f"{msgs[0]['content']}\n\n{text}"}
        else:
            msgs.insert(0, {"role": "system", "content": text})
    return msgs, variables


def tools_key(req: GenerationRequest) -> str | None:
    """The functions of `req.tools` as canonical JSON (None: no tools): what a session's turns
    must agree on."""
    if not req.tools:
        return None
    return json.dumps([t["function"] for t in req.tools], sort_keys=True, ensure_ascii=False)


def call_names(req: GenerationRequest, text: str, rid: str) -> dict[str, str]:
    """{call id: function name} of the calls the reply `text` of request `rid` makes."""
    return {c["id"]: c["function"]["name"] for c in tool_calls(req, text, rid) or ()}


def _has_tool_turns(req: GenerationRequest) -> bool:
    return any(m.role == "tool" or m.tool_calls for m in req.messages or ())


def parse_tool_calls(text: str, names: Sequence[str]) -> list[tuple[str, dict[str, Any]]] | None:
    """[(name, arguments)] when `text` is a tool call of one of `names`, else None."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        body = text.strip()
        m = _FENCE.match(body)
        blocks = [m.group(1) if m else body]
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        # Llama 3.x's templates ask for {"name", "parameters"}, as llama-server reads them
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append((obj["name"], args))
    return calls or None


def may_call_tools(req: GenerationRequest) -> bool:
    """Whether the reply may be a tool call (then a stream holds it until it is complete)."""
    return bool(_offered(req))


def tool_calls(req: GenerationRequest, text: str, rid: str) -> list[dict[str, Any]] | None:
    """The reply's `tool_calls` (OpenAI's shape) when `text` is a call, else None."""
    functions = _offered(req)
    if not functions:
        return None
    calls = parse_tool_calls(text, [f["name"] for f in functions])
    if calls is None:
        return None
    return [{"id": f"call_{rid.removeprefix('req-')}_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for i, (name, args) in enumerate(calls)]


def call_content(text: str) -> str | None:
    """The content of a reply that is a call: the text before its first `<tool_call>` block
    without trailing whitespace (None: none, or a bare JSON call)."""
    at = text.find(_MARK)
    return (text[:at].rstrip() or None) if at > 0 else None


def reply_content(text: str, calls: bool) -> str:
    """What a reply says as text: all of it, or for a call (`calls`) its `call_content`
    ("" if none). The unstreamed replies and a gated stream send exactly this."""
    return (call_content(text) or "") if calls else text


class CallGate:
    """What of a reply that may call tools a stream can send now (module docstring)."""

    def __init__(self) -> None:
        self.text = ""  # the reply so far
        self.sent = 0  # characters of it sent as text
        self.shut = False  # a call may have begun: nothing more is sent before the end

    def feed(self, piece: str) -> str:
        """Add the next piece of the reply; the text that may be sent now ("" if none)."""
        self.text += piece
        if self.shut:
            return ""
        text = self.text
        if self.sent == 0:
            body = text.lstrip()
            if not body:
                return ""
            if body[0] in "{`":
                self.shut = True  # a bare or fenced JSON call: the whole reply decides
                return ""
        at = text.find(_MARK, self.sent)
        if at >= 0:
            self.shut, limit = True, at
        else:
            limit = len(text) - held_tail(text, _MARK)
        out = text[self.sent:limit].rstrip()  # trailing whitespace waits for what follows
        self.sent += len(out)
        return out

    def rest(self, calls: bool) -> str:
        """At the end: the text still to send (`calls`: the reply is a call, its content only)."""
        return reply_content(self.text, calls)[self.sent:]
