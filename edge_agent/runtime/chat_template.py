"""Chat templates from the GGUF, rendered the way transformers' `apply_chat_template` renders them.

A GGUF carries its model's chat template as Jinja text under `tokenizer.chat_template` (named
variants under `tokenizer.chat_template.NAME`; `tool_use` is picked when tools are given, as
transformers and llama.cpp pick it). `GGUFChatTemplate` compiles it once and renders a
conversation to the prompt text the model was trained on.

Invariants owned here:
- Same text as transformers (tests/test_chat_template.py holds strings transformers rendered):
  jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
  extension and a `{% generation %}` tag, transformers' globals (`raise_exception`,
  `strftime_now`, a `dict` without class attributes, a `namespace` that refuses `_` names) and
  its `tojson` (ensure_ascii=False; indent, separators, sort_keys). Variables: `messages` with
  None-valued keys dropped and reasoning fields aliased as transformers does, `tools` and
  `documents` (None unless given), `add_generation_prompt`, the special-token texts transformers'
  GGUF loader sets (`bos_token`, `eos_token`, `unk_token`, `pad_token`, those the file names),
  then the caller's extra variables (which may override the token texts, as in transformers).
- The template is untrusted: it arrives inside a model file. It runs in jinja's immutable
  sandbox (no `_` attributes, no mutation of lists or dicts, no file, module or code access), and
  an access the sandbox forbids raises `ChatTemplateSandboxError` at once. Every render is
  bounded (`RenderLimits`): the output and every string, list or number the template builds are
  capped at `max_chars`, operators, methods and filters that would build a bigger value are
  refused before they allocate, and a wall-clock budget is checked at each attribute, item, call,
  operator, filter, output expression and output chunk.
- Where this differs from transformers, on input transformers accepts: `add_generation_prompt`
  defaults to True; message values must be JSON data (transformers renders other objects as
  "<TypeName>"); an unsafe attribute raises instead of rendering as ""; the bounds above.
- A GGUF without `tokenizer.chat_template` is an error (`MissingChatTemplateError`), never a
  guessed ChatML default: a guessed format silently gives a prompt the model was not trained on.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge_agent.errors import EdgeAgentError, ModelFileError
from edge_agent.runtime.chat import ChatMessageError

__all__ = [
    "GGUFChatTemplate",
    "RenderLimits",
    "ChatMessageError",
    "ChatTemplateError",
    "ChatTemplateLimitError",
    "ChatTemplateSandboxError",
    "MissingChatTemplateError",
    "TEMPLATE_KEY",
]

TEMPLATE_KEY = "tokenizer.chat_template"
# The special tokens transformers' GGUF loader sets, by the GGUF key holding each one's id.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# apply_chat_template's own parameters: passed as template variables they would render silently
# wrong, so they are refused.
_NOT_VARIABLES = frozenset({
    "chat_template", "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "conversation", "messages",
})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ROLE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_REPLACE = ("replace the template (gguf-new-metadata --chat-template-file chat_template.jinja "
            "IN.gguf OUT.gguf) or use another model file")


class ChatTemplateError(ChatMessageError):
    """The model's template refused these messages (raise_exception, a missing value, ...)."""


class MissingChatTemplateError(ModelFileError):
    """The GGUF has no `tokenizer.chat_template`, so it has no chat format to render."""


class ChatTemplateSandboxError(ModelFileError):
    """The template tried something the sandbox forbids (the model file is broken or hostile)."""


class ChatTemplateLimitError(ChatMessageError):
    """A render went past its bounds (`RenderLimits`): too large, too slow or too deep (these
    messages cannot be rendered: the daemon answers 400)."""


@dataclass(frozen=True)
class RenderLimits:
    """Bounds of one render: characters (output and any value built), wall-clock seconds."""

    max_chars: int = 1 << 20
    max_seconds: float = 2.0


# -- the bounded sandbox ------------------------------------------------------------------------

_T = TypeVar("_T")


class _Exceeded(Exception):
    """Raised inside a render when a bound is reached; mapped to ChatTemplateLimitError."""


class _Budget:
    """The bounds of the render in progress (one per render, found through a context variable)."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self._sizes: dict[int, tuple[Any, int]] = {}  # id -> (object kept alive, size)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Exceeded(f"it ran longer than {self.limits.max_seconds:g} s")

    def ensure(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise _Exceeded(f"{what} would build a value of about {size} characters or items, "
                            f"more than the limit of {self.limits.max_chars}")

    def check(self, value: _T, what: str) -> _T:
        self.ensure(self.size(value), what)
        return value

    def size(self, value: Any) -> int:
        """Characters (or items) `value` holds, every occurrence of a shared value counted (as
        json or str would write it); exact up to the cap, some number above it past the cap."""
        return self._size(value, self.limits.max_chars + 1, ())

    def _size(self, v: Any, cap: int, namespaces: tuple[int, ...]) -> int:
        if isinstance(v, (str, bytes)):
            return len(v)
        if v is None or isinstance(v, (bool, float)):
            return 1
        if isinstance(v, int):
            return v.bit_length() // 3 + 1
        if isinstance(v, jinja2.utils.Namespace):  # mutable: never memoised; may hold itself
            if id(v) in namespaces:
                return 0
            attrs = object.__getattribute__(v, "_Namespace__attrs")
            return self._sum(attrs, cap, (*namespaces, id(v)))
        if not isinstance(v, (list, tuple, dict, set, frozenset)):
            return 0
        known = self._sizes.get(id(v))
        if known is not None and known[0] is v:
            return known[1]
        total = self._sum(v, cap, namespaces)
        self._sizes[id(v)] = (v, total)  # the sandbox cannot change lists, dicts or sets
        return total

    def _sum(self, items: Any, cap: int, namespaces: tuple[int, ...]) -> int:
        total = len(items)
        for item in (*items.keys(), *items.values()) if isinstance(items, dict) else items:
            if total >= cap:
                break
            total += self._size(item, cap, namespaces)
        return total


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_budget",
                                                                       default=None)


def _budget() -> _Budget:
    # Outside a render (jinja folding constants while compiling) the default bounds apply.
    return _BUDGET.get() or _Budget(RenderLimits())


def _spec_numbers(spec: str) -> int:
    return sum(int(n) for n in re.findall(r"\d+", spec))


def _values(values: Any) -> list[Any]:
    if isinstance(values, Mapping):
        return list(values.values())
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _largest(values: Any) -> int:
    return max((_budget().size(v) for v in _values(values)), default=0)


def _ints(values: Any) -> int:
    return sum(abs(v) for v in _values(values) if isinstance(v, int))


def _percent_estimate(fmt: str | bytes, args: Any) -> int:
    """Upper bound on the size of `fmt % args`: each conversion may repeat the largest
    argument, widths and precisions included."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    specs = re.findall(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?", text)
    widths = sum(int(n) for spec in specs for n in spec if n.isdigit())
    stars = _ints(args) if any("*" in spec for spec in specs) else 0
    return len(text) + len(specs) * _largest(args) + widths + stars


def _format_estimate(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Upper bound on the size of `fmt.format(*args, **kwargs)`, as for `%`."""
    values = [*args, *kwargs.values()]
    total = len(fmt)
    try:
        for _, name, spec, _ in string.Formatter().parse(fmt):
            if name is not None:
                total += _largest(values)
            if spec:
                total += _spec_numbers(spec) + (_ints(values) if "{" in spec else 0)
    except ValueError:
        pass  # the call itself reports the bad format
    return total


def _str_method_estimate(method: Any, args: tuple[Any, ...],
                         kwargs: Mapping[str, Any]) -> int | None:
    """Upper bound on what a str/bytes method builds, for the methods that can multiply size."""
    s, name = method.__self__, method.__name__
    n = len(s)
    a = list(args) + list(kwargs.values())
    if name in ("center", "ljust", "rjust", "zfill") and a and isinstance(a[0], int):
        return max(n, a[0])
    if name == "expandtabs":
        tab = a[0] if a and isinstance(a[0], int) else 8
        tabs: int = s.count("\t" if isinstance(s, str) else b"\t")
        return n + tabs * max(tab, 0)
    if name == "replace" and len(a) >= 2 and isinstance(a[0], type(s)) and isinstance(
            a[1], type(s)):
        count = n + 1 if not a[0] else s.count(a[0])
        return n + count * len(a[1])
    if name == "translate" and a and isinstance(a[0], Mapping):
        longest = max((len(v) for v in a[0].values() if isinstance(v, (str, bytes))), default=1)
        return n * max(longest, 1)
    return None


class _TemplateDict:
    """`dict` for templates: calling it builds a dict; no class attributes to climb through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` for templates: refuses `_` names; values it stores are size-checked."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        budget = _budget()
        budget.tick()
        budget.check(value, f"namespace attribute {name!r}")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace cannot store the underscore-prefixed attribute "
                                f"{name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > jinja2.sandbox.MAX_RANGE:
        raise _Exceeded(f"range() of {len(rng)} items is more than the sandbox's "
                        f"{jinja2.sandbox.MAX_RANGE}")
    return rng


def _bounded_lipsum(lipsum: Callable[..., str]) -> Callable[..., str]:
    """jinja's lipsum global, refused when it would write more than the cap (it loops in
    Python without passing a check)."""

    @functools.wraps(lipsum)
    def checked(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        _budget().ensure(n * max * 16, "lipsum()")
        return lipsum(n, html, min, max)

    return checked


def _raise_exception(message: Any) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _filter_estimate(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Upper bound on what the filters that can multiply size build (args without pass-arg)."""
    size = _budget().size
    a = list(args) + list(kwargs.values())
    first = str(a[0]) if a and isinstance(a[0], str) else ""
    if name == "center":
        width = kwargs.get("width", args[1] if len(args) > 1 else 80)
        return len(first) + (width if isinstance(width, int) else 0)
    if name == "indent":
        width = kwargs.get("width", args[1] if len(args) > 1 else 4)
        per_line = width if isinstance(width, int) else len(str(width))
        return len(first) + (first.count("\n") + 1) * per_line
    if name == "replace" and len(a) >= 3:
        return _str_method_estimate(str(a[0]).replace, (str(a[1]), str(a[2])), {})
    if name == "wordwrap":
        wrap = kwargs.get("wrapstring", args[3] if len(args) > 3 else None) or "\n"
        columns: int = kwargs.get("width", args[1] if len(args) > 1 else 79)
        return len(first) + (first.count(" ") + first.count("\n") + len(first) // max(
            columns, 1) + 1) * len(str(wrap))
    if name == "format" and a and isinstance(a[0], str):
        return _percent_estimate(a[0], list(args[1:]) + list(kwargs.values()))
    if name in ("batch", "slice"):
        count = kwargs.get("linecount", kwargs.get("slices", args[1] if len(args) > 1 else 0))
        return count if isinstance(count, int) else 0
    if name == "join" and a:
        sep = kwargs.get("d", args[1] if len(args) > 1 else "")
        return size(a[0]) + len(a[0]) * len(str(sep))
    if name == "tojson" and a:
        indent = kwargs.get("indent", args[2] if len(args) > 2 else None)
        seps = kwargs.get("separators", args[3] if len(args) > 3 else None)
        step = (indent if isinstance(indent, int) else len(str(indent or ""))) + 2
        step += sum(len(str(s)) for s in seps) if isinstance(seps, (list, tuple)) else 2
        return size(a[0]) * (1 + step * _depth(a[0]))
    return None


def _depth(value: Any, limit: int = 64) -> int:
    """Nesting depth of lists/dicts (capped), for the indentation json.dumps adds."""
    depth, level = 0, [value]
    while level and depth < limit:
        nxt: list[Any] = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, (list, tuple)):
                nxt.extend(v)
        depth, level = depth + 1, [v for v in nxt if isinstance(v, (list, tuple, dict))]
    return depth


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        what = f"the filter {name!r}"
        if name == "join" and len(args) > skip and not isinstance(args[skip], Sequence):
            args = (*args[:skip], list(args[skip]), *args[skip + 1:])
        for value in (*args[skip:], *kwargs.values()):
            budget.check(value, what)
        try:
            estimate = _filter_estimate(name, args[skip:], kwargs)
        except (TypeError, ValueError):
            estimate = None  # arguments the filter itself will refuse
        if estimate is not None:
            budget.ensure(estimate, what)
        return budget.check(func(*args, **kwargs), what)

    return guarded


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with every way to grow a value or loop for long checked."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        what = f"the operator {operator!r}"
        if operator == "*":
            if isinstance(left, int) and not isinstance(right, int):
                left, right = right, left
            if isinstance(right, int) and not isinstance(right, bool):
                if isinstance(left, int):
                    budget.ensure((left.bit_length() + right.bit_length()) // 3, what)
                elif isinstance(left, (str, bytes, list, tuple)):
                    budget.ensure(budget.size(left) * max(right, 0), what)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0:
                budget.ensure(right * left.bit_length() // 3, what)
        elif operator == "%" and isinstance(left, (str, bytes)):
            budget.ensure(_percent_estimate(left, right), what)
        return budget.check(self.binop_table[operator](left, right), what)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            budget = _budget()
            mapping = args[0] if is_map and args and isinstance(args[0], Mapping) else kwargs
            budget.ensure(_format_estimate(fmt, () if is_map else args, mapping), "str.format")
            return budget.check(wrapped(*args, **kwargs), "str.format")

        return functools.update_wrapper(checked, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        what = f"the call of {getattr(__obj, '__name__', type(__obj).__name__)!r}"
        for value in (*args, *kwargs.values()):
            budget.check(value, what)
        owner = getattr(__obj, "__self__", None)
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(owner, (str, bytes)):
            if __obj.__name__ == "join" and args and not isinstance(args[0], Sequence):
                args = (list(args[0]), *args[1:])
            if __obj.__name__ == "join" and args:
                budget.ensure(budget.size(args[0]) + len(args[0]) * len(owner), what)
            estimate = _str_method_estimate(__obj, args, kwargs)
            if estimate is not None:
                budget.ensure(estimate, what)
        return budget.check(super().call(__context, __obj, *args, **kwargs), what)


def _finalize(value: Any) -> Any:
    budget = _budget()
    budget.tick()
    return budget.check(value, "an output expression")


def _concat(chunks: Any) -> str:
    """jinja's "".join for macro bodies and captured blocks, size-checked before joining."""
    budget = _budget()
    parts = list(chunks)
    budget.tick()
    budget.ensure(sum(len(p) for p in parts), "a macro or block")
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    version = tuple(int(n) for n in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < (3, 1, 6):
        raise EdgeAgentError(
            f"jinja2 {jinja2.__version__} is installed; chat templates need jinja2 >= 3.1.6 "
            "(older sandboxes have known escapes). Hint: pip install -U 'jinja2>=3.1.6'."
        )
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.concat = _concat  # type: ignore[method-assign]  # jinja's hook: set per environment
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["range"] = _range
    env.globals["lipsum"] = _bounded_lipsum(jinja2.utils.generate_lorem_ipsum)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# -- messages -----------------------------------------------------------------------------------

def _plain(value: Any, where: str) -> Any:
    """`value` rebuilt from exact JSON types (what transformers' _plain_template_data does for
    JSON input); anything else is refused."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise ChatMessageError(f"{where} is a {type(value).__name__}, not JSON data. Hint: send "
                           "strings, numbers, booleans, null, lists and objects only.")


def _check_tool_calls(calls: Any, where: str) -> None:
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
        raise ChatMessageError(f"{where}: 'tool_calls' must be a list, got "
                               f"{type(calls).__name__}. Hint: send [{{'type': 'function', "
                               "'function': {'name': NAME, 'arguments': {...}}}].")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments", {}), (str, Mapping)):
            raise ChatMessageError(
                f"{where}: tool call #{j} must be {{'function': {{'name': STRING, 'arguments': "
                f"OBJECT or JSON STRING}}}}, got {call!r:.200}. Hint: use the OpenAI tool-call "
                "shape."
            )


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatMessageError(
            f"chat messages must be a list of {{'role': ..., 'content': ...}} objects, got "
            f"{type(messages).__name__}. Hint: wrap a single prompt as "
            "[{'role': 'user', 'content': PROMPT}]."
        )
    if not messages:
        raise ChatMessageError("chat messages: the list is empty. Hint: send at least one "
                               "message, e.g. [{'role': 'user', 'content': PROMPT}].")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"chat message #{i}"
        if not isinstance(msg, Mapping):
            raise ChatMessageError(f"{where} is a {type(msg).__name__}, not an object with "
                                   "'role' and 'content'. Hint: send {'role': 'user', "
                                   "'content': TEXT}.")
        msg = {k: v for k, v in msg.items() if v is not None}  # as transformers normalises
        role = msg.get("role")
        if not isinstance(role, str) or not _ROLE.fullmatch(role):
            raise ChatMessageError(f"{where}: 'role' must be a short name (letters, digits, "
                                   f"'_.:-'), got {role!r:.80}. Hint: use 'system', 'user', "
                                   "'assistant' or 'tool'.")
        where = f"{where} (role {role!r})"
        calls = msg.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ChatMessageError(f"{where}: only assistant messages carry 'tool_calls'. "
                                       "Hint: send the tool's answer as {'role': 'tool', "
                                       "'content': TEXT}.")
            _check_tool_calls(calls, where)
        content = msg.get("content")
        if content is None:
            if calls is None:
                raise ChatMessageError(f"{where}: 'content' is missing or null. Hint: send the "
                                       "text as a string (null is for assistant tool calls).")
        elif not isinstance(content, str):
            parts_ok = isinstance(content, Sequence) and not isinstance(content, bytes) and all(
                isinstance(p, Mapping) and isinstance(p.get("type"), str) for p in content)
            if not parts_ok:
                raise ChatMessageError(
                    f"{where}: 'content' must be a string or a list of parts like "
                    f"{{'type': 'text', 'text': ...}}, got {type(content).__name__}. Hint: send "
                    "the message text as a JSON string."
                )
        plain = _plain(msg, where)
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:  # transformers' _alias_reasoning_fields
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _check_list_of_objects(value: Any, name: str) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not all(
            isinstance(v, Mapping) for v in value):
        raise ChatMessageError(f"{name!r} must be a list of objects, got {value!r:.200}. "
                               f"Hint: send {name} as a JSON array of objects.")
    plain: list[Any] = _plain(list(value), name)  # a list rebuilt is a list
    return plain


# -- the template -------------------------------------------------------------------------------

def _token_text(metadata: Mapping[str, Any], key: str) -> str | None:
    token_id, tokens = metadata.get(key), metadata.get("tokenizer.ggml.tokens")
    if tokens is None or not isinstance(token_id, int) or isinstance(token_id, bool):
        return None
    if not 0 <= token_id < len(tokens):
        return None
    text = tokens[token_id]
    return text if isinstance(text, str) else None


@dataclass(frozen=True, eq=False)
class GGUFChatTemplate:
    """A model's chat template, compiled once; `render` gives the prompt text."""

    template: str
    source: str = ""
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    tool_use_template: str | None = None
    limits: RenderLimits = RenderLimits()
    _compiled: dict[str, jinja2.Template] = field(default_factory=dict, init=False, repr=False,
                                                  compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "special_tokens", dict(self.special_tokens))
        self._compiled["default"] = self._compile(self.template, TEMPLATE_KEY)
        if self.tool_use_template is not None:
            self._compiled["tool_use"] = self._compile(self.tool_use_template,
                                                       f"{TEMPLATE_KEY}.tool_use")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, source: str,
                      limits: RenderLimits | None = None) -> GGUFChatTemplate:
        """The template of a GGUF's metadata (`GGUFFile(path).metadata`)."""
        template = metadata.get(TEMPLATE_KEY)
        if template is None:
            raise MissingChatTemplateError(
                f"{source}: the GGUF has no {TEMPLATE_KEY}, so edge-agent does not know the "
                "chat format the model was trained on (no default format is assumed). Hint: "
                "send a plain prompt instead of messages, use an instruction-tuned model file "
                "that carries its template, point models.NAME.chat_template_file at the "
                "model's template (llama.cpp engine), or add it to the file with "
                "gguf-new-metadata --chat-template-file chat_template.jinja IN.gguf OUT.gguf."
            )
        tool_use = metadata.get(f"{TEMPLATE_KEY}.tool_use")
        for key, value in ((TEMPLATE_KEY, template), (f"{TEMPLATE_KEY}.tool_use", tool_use)):
            if value is not None and not isinstance(value, str):
                raise ModelFileError(f"{source}: {key} is a {type(value).__name__}, not a "
                                     f"string of Jinja. Hint: {_REPLACE}.")
        specials = {name: text for name, key in SPECIAL_TOKEN_KEYS.items()
                    if (text := _token_text(metadata, key)) is not None}
        return cls(template=template, source=source, special_tokens=specials,
                   tool_use_template=tool_use, limits=limits or RenderLimits())

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def _compile(self, text: str, key: str) -> jinja2.Template:
        try:
            return _environment().from_string(text)
        except TemplateSyntaxError as exc:
            raise ModelFileError(f"{self.source}: {key} is not valid Jinja: {exc.message} "
                                 f"(template line {exc.lineno}). Hint: {_REPLACE}.") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for `messages`, as transformers' apply_chat_template(tokenize=False).

        `extra` becomes template variables (e.g. `documents=[...]`, `enable_thinking=False`).
        Raises ChatMessageError (bad messages), ChatTemplateError (the template refused them),
        ChatTemplateSandboxError (a forbidden access), ChatTemplateLimitError (a bound).
        """
        refused = _NOT_VARIABLES.intersection(extra)
        if refused:
            raise TypeError(f"render() does not take {', '.join(sorted(refused))} (parameters of "
                            "transformers' apply_chat_template, not template variables)")
        if not isinstance(add_generation_prompt, bool):
            raise TypeError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        chat = _check_messages(messages)
        tools_plain = _check_list_of_objects(tools, "tools")
        documents = _check_list_of_objects(extra.pop("documents", None), "documents")
        variables = {**self.special_tokens, **_plain(extra, "chat template variables")}
        limits = self.limits
        try:
            size = _Budget(limits).size([chat, tools_plain, documents, variables])
        except RecursionError:
            raise ChatMessageError("chat messages: values are nested too deeply. Hint: send "
                                   "flatter JSON.") from None
        if size > limits.max_chars:
            raise ChatMessageError(
                f"chat messages: about {size} characters with tools and variables, more than the "
                f"{limits.max_chars} a prompt may have. Hint: shorten the conversation."
            )
        name = "tool_use" if tools_plain is not None and "tool_use" in self._compiled else "default"
        return self._run(self._compiled[name], dict(
            messages=chat, tools=tools_plain, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables))

    def _run(self, compiled: jinja2.Template, variables: dict[str, Any]) -> str:
        budget = _Budget(self.limits)
        token = _BUDGET.set(budget)
        where = self.source or "chat template"
        try:
            parts, total = [], 0
            for chunk in compiled.generate(**variables):
                total += len(chunk)
                budget.ensure(total, "the rendered prompt")
                budget.tick()
                parts.append(chunk)
            return "".join(parts)
        except _Exceeded as exc:
            raise ChatTemplateLimitError(
                f"{where}: rendering the chat template stopped: {exc}. Hint: shorten the "
                "conversation; if it is short, the template in this model file is broken or "
                f"hostile: {_REPLACE}."
            ) from None
        except (RecursionError, MemoryError) as exc:
            raise ChatTemplateLimitError(
                f"{where}: rendering the chat template stopped: {type(exc).__name__} (the "
                f"template recurses or allocates without bound). Hint: {_REPLACE}."
            ) from None
        except SecurityError as exc:
            raise ChatTemplateSandboxError(
                f"{where}: the chat template tried something the sandbox forbids: {exc}. "
                f"The template in this model file is broken or hostile. Hint: {_REPLACE}."
            ) from None
        except UndefinedError as exc:
            raise ChatTemplateError(
                f"{where}: the chat template needs a value these messages lack: {exc}. Hint: "
                "check that each message has the fields this model's template reads "
                "(e.g. 'content'); the template may not support this kind of message."
            ) from None
        except TemplateError as exc:
            raise ChatTemplateError(
                f"{where}: the model's chat template refused these messages: {exc}. Hint: "
                "change the conversation to the shape this model accepts."
            ) from None
        except Exception as exc:  # TypeError, ValueError, ... raised by the template's code
            raise ChatTemplateError(
                f"{where}: the chat template failed on these messages: "
                f"{type(exc).__name__}: {exc}. Hint: this model's template may not support this "
                "kind of message (tool calls, content parts, roles)."
            ) from None
        finally:
            _BUDGET.reset(token)
