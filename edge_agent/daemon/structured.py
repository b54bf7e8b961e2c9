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
- A reply that may call tools is read by `CallGate`, left to right, the same way streamed or
  not (`split_reply` feeds it the whole reply): what it sends is what the unstreamed reply
  says, whatever the pieces.
  - Text streams as it comes until a `<tool_call>` (a tail that could begin one, and trailing
    whitespace, wait for what follows). A reply whose first non-blank character is `{` or a
    backtick is read as a bare (or ```json-fenced) JSON call, until it is not one: a reply
    that does not open a JSON object, bare or in a ``` or ```json fence, is text.
  - A call is made once its text begins `{"name": "<an offered function>", "arguments": {`
    ("parameters" for "arguments", as Llama 3.x writes it; whitespace anywhere between): its
    name goes out then, and its arguments' text as it comes, as written, up to the brace that
    closes them. A reply cut short leaves the call's arguments cut short (finish_reason
    "length"), as OpenAI's do; Ollama's routes, whose calls carry an object, leave such a call
    out (protocol/ollama.ollama_tool_calls).
  - After a call, text is left out; each further `<tool_call>` block is a call as above, or,
    in another form, one if `parse_tool_calls` reads it when the block closes. A bare call is
    the whole reply: what follows it is left out.
  - A reply whose first block (or bare object) does not begin as a call is held to the end:
    `parse_tool_calls` then reads it whole, as `<tool_call>{json}</tool_call>` blocks every
    one of which is a call of an offered function, or one JSON object {"name", "arguments"}
    (in any key order, a ```json fence allowed, arguments an object or its JSON text); its
    content is the text before the first block. Anything else is text.
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

__all__ = ["TOOLS_PROMPT", "Call", "CallGate", "call_id", "call_names", "chat_prompt",
           "grammar_for", "held_tail", "jinja_template", "offered_names",
           "openai_calls", "parse_tool_calls", "split_reply", "template_messages", "tool_calls",
           "tools_key"]

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


def offered_names(req: GenerationRequest) -> list[str]:
    """The names of the functions the reply may call (none: it is text; else a stream reads
    it through a `CallGate`)."""
    return [f["name"] for f in _offered(req)]


def tool_calls(req: GenerationRequest, text: str, rid: str) -> list[dict[str, Any]] | None:
    """The reply's `tool_calls` (OpenAI's shape) when `text` is a call, else None."""
    return split_reply(req, text, rid)[1]


def split_reply(req: GenerationRequest, text: str,
                rid: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(content, tool calls in OpenAI's shape or None) of the reply `text`: what a `CallGate`
    fed the whole reply sends (the text of a reply that may not call tools)."""
    names = offered_names(req)
    if not names:
        return text, None
    gate = CallGate(names)
    content = gate.feed(text) + gate.end()
    return content, (openai_calls(gate.calls, rid) or None)


def call_id(rid: str, index: int) -> str:
    """The id of call `index` of request `rid`'s reply."""
    return f"call_{rid.removeprefix('req-')}_{index}"


def openai_calls(calls: Sequence[Call], rid: str) -> list[dict[str, Any]]:
    """`calls` in OpenAI's shape (arguments their text)."""
    return [{"id": call_id(rid, c.index), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class Call:
    """One call of a reply: its place among the reply's calls, name and arguments' text so
    far; `closed` once its arguments are whole (or, cut short, never)."""

    __slots__ = ("arguments", "closed", "index", "name")

    def __init__(self, index: int, name: str, arguments: str = "", closed: bool = False) -> None:
        self.index, self.name, self.arguments, self.closed = index, name, arguments, closed

    def __repr__(self) -> str:
        return f"Call({self.index}, {self.name!r}, {self.arguments!r}, closed={self.closed})"


_CLOSE = "</tool_call>"
_FENCE_OPEN: tuple[tuple[tuple[str, ...], bool], ...] = ((("```",), False), (("json",), True))


def _head(names: Sequence[str]) -> tuple[tuple[tuple[str, ...], bool], ...]:
    """The tokens a call begins with, whitespace allowed between them:
    `{"name": "<offered name>", "arguments": {` ("parameters" for "arguments")."""
    return ((("{",), False), (('"name"',), False), ((":",), False),
            (tuple(json.dumps(n, ensure_ascii=False) for n in names), False), ((",",), False),
            (('"arguments"', '"parameters"'), False), ((":",), False), (("{",), False))


def _match(text: str, at: int,
           tokens: Sequence[tuple[tuple[str, ...], bool]]) -> tuple[int, list[str]] | bool:
    """Match `tokens` (alternatives, optional) in `text` from `at`, whitespace between them:
    (where the match ends, the alternatives matched), True: `text` ends before it is known,
    False: it does not match. Each token's alternatives are prefix-free."""
    got = []
    for alternatives, optional in tokens:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        if at == len(text):
            return True
        rest = text[at:at + max(map(len, alternatives))]
        hit = next((a for a in alternatives if rest.startswith(a)), None)
        if hit is None:
            if any(a.startswith(rest) for a in alternatives) and at + len(rest) == len(text):
                return True  # the text so far is the start of one
            if optional:
                continue
            return False
        got.append(hit)
        at += len(hit)
    return at, got


class CallGate:
    """What of a reply that may call tools a stream can send now (module docstring)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.head = _head(self.names)
        self.text = ""  # the reply so far
        self.pos = 0  # where the scan is
        self.sent = 0  # characters of the reply accounted for (sent, or left out)
        self.said = 0  # where the text sent ends
        self.state = "start"  # start | text | head | args | after | block | bare | hold | done
        self.calls: list[Call] = []
        self.deltas: list[tuple[int, str | None, str]] = []  # (call, name when new, arguments)
        self.at = 0  # where the block (or bare call) being matched begins its call
        self.depth, self.quoted, self.escaped = 0, False, False
        self.bare = False  # the call being read is a bare JSON object: nothing follows it

    def take(self) -> list[tuple[int, str | None, str]]:
        """The calls' parts found since the last take: (call index, its name if the call is
        new, more of its arguments' text); a call's parts are merged."""
        out: list[tuple[int, str | None, str]] = []
        for index, name, args in self.deltas:
            if name is None and not args:
                continue
            if out and out[-1][0] == index:
                out[-1] = (index, out[-1][1], out[-1][2] + args)
            else:
                out.append((index, name, args))
        self.deltas = []
        return out

    def _commit(self, name: str, arguments: str = "", closed: bool = False) -> Call:
        call = Call(len(self.calls), name, arguments, closed)
        self.calls.append(call)
        self.deltas.append((call.index, name, arguments))
        return call

    def feed(self, piece: str) -> str:
        """Add the next piece of the reply; the text that may be sent now ("" if none)."""
        self.text += piece
        out = ""
        while True:
            state, text = self.state, self.text
            if state == "start":
                body = text.lstrip()
                if not body:
                    return out
                self.pos = len(text) - len(body)
                self.at = self.pos
                self.state = "bare" if body[0] in "{`" else "text"
            elif state == "text":  # no call yet: text until a <tool_call>
                at = text.find(_MARK, self.pos)
                limit = at if at >= 0 else len(text) - held_tail(text, _MARK)
                part = text[self.said:limit].rstrip()  # trailing whitespace waits
                out += part
                self.said += len(part)
                self.sent = self.said
                if at < 0:
                    self.pos = max(self.pos, limit)
                    return out
                self.state, self.pos, self.at = "head", at + len(_MARK), at + len(_MARK)
            elif state in ("head", "bare"):
                tokens = self.head if state == "head" else (
                    (*_FENCE_OPEN, *self.head) if text.startswith("`", self.at) else self.head)
                got = _match(text, self.at, tokens)
                if got is True:
                    return out
                if got is False:
                    if self.calls:  # another form: decided when its block closes
                        self.state = "block"
                        continue
                    opening = tokens[:len(tokens) - len(self.head) + 1]  # ``` or ```json, `{`
                    if state == "bare" and _match(text, self.at, opening) is False:
                        self.state = "text"  # not JSON (`code`, ```python): text
                        continue
                    self.state = "hold"  # no call yet: the whole reply decides
                    return out
                end, words = got
                self._commit(json.loads(words[-5]))
                self.pos = self.sent = end - 1  # the arguments' `{`
                self.depth, self.quoted, self.escaped = 0, False, False
                self.bare = state == "bare"
                self.state = "args"
            elif state == "args":
                call = self.calls[-1]
                i = self.pos
                while i < len(text):
                    c = text[i]
                    i += 1
                    if self.quoted:
                        if self.escaped:
                            self.escaped = False
                        elif c == "\\":
                            self.escaped = True
                        elif c == '"':
                            self.quoted = False
                    elif c == '"':
                        self.quoted = True
                    elif c in "{[":
                        self.depth += 1
                    elif c in "}]":
                        self.depth -= 1
                        if self.depth <= 0:
                            call.closed = True
                            break
                part = text[self.pos:i]
                call.arguments += part
                self.deltas.append((call.index, None, part))
                self.pos = self.sent = i
                if not call.closed:
                    return out
                self.state = "done" if self.bare else "after"
            elif state == "after":  # a call was made: the rest is calls, or left out
                at = text.find(_MARK, self.pos)
                if at < 0:
                    self.pos = self.sent = len(text) - held_tail(text, _MARK)
                    return out
                self.state, self.pos, self.at = "head", at + len(_MARK), at + len(_MARK)
                self.sent = at
            elif state == "block":  # a block in another form, after a call: whole or nothing
                close = text.find(_CLOSE, self.pos)
                if close < 0:
                    self.pos = max(self.pos, len(text) - len(_CLOSE) + 1)  # no rescan
                    return out
                found = parse_tool_calls(text[self.at - len(_MARK):close + len(_CLOSE)],
                                         self.names)
                for name, args in found or ():
                    self._commit(name, json.dumps(args, ensure_ascii=False), closed=True)
                self.state, self.pos = "after", close + len(_CLOSE)
                self.sent = self.pos
            else:  # hold (decided at the end) or done (the rest is left out)
                if state == "done":
                    self.pos = self.sent = len(text)
                return out

    def end(self) -> str:
        """At the end of the reply: the text still to send. A reply held whole (`hold`) is a
        call if `parse_tool_calls` says so (its content the text before its first block,
        sent already), else text."""
        out = self.feed("")
        if not self.calls and self.state in ("head", "bare", "hold"):
            found = parse_tool_calls(self.text, self.names)
            if found is None:
                out += self.text[self.said:]  # text: a block or an object cut short, or not a call
            for name, args in found or ():
                self._commit(name, json.dumps(args, ensure_ascii=False), closed=True)
        elif self.state in ("start", "text"):
            out += self.text[self.said:]  # held whitespace, or a tail like "<tool_"
        self.said = self.sent = self.pos = len(self.text)
        self.state = "done"
        return out
