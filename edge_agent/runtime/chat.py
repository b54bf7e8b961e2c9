"""ChatML chat template, without a Jinja engine.

The model's `tokenizer.chat_template` is a Jinja program; we do not run it. We recognise the
ChatML shape (`<|im_start|>role\\ncontent<|im_end|>\\n`, generation prompt
`<|im_start|>assistant\\n`) and take the default system prompt — the one the template inserts
when the first message is not a system message — out of the template text with a regex.

Invariants owned here:
- Role markers are the special token ids of `<|im_start|>` / `<|im_end|>`, never text that
  the tokenizer could split; everything between two markers (role name, newline, content) is one
  plain-text fragment, so special-token text inside a message is NOT special. This is how llama.cpp
  and transformers tokenize the rendered template (special tokens split the text into fragments
  that are tokenized independently).
- Semantics follow the SmolLM2 template exactly: the default system prompt is inserted only when
  there is at least one message and the first one is not `system`; an empty message list renders
  only the generation prompt.
- A template that is not ChatML is refused with ModelFileError (we would silently produce the
  wrong prompt otherwise); a ChatML vocabulary with no template, or a template whose default
  system prompt cannot be read, falls back to no default system prompt and says so in `note`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from edge_agent.errors import EXIT_USAGE, EdgeAgentError, ModelFileError

__all__ = ["ChatTemplate", "ChatMessageError", "IM_START", "IM_END", "require_chatml"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# `<|im_start|>system` + a newline (real, or `\n` escaped inside a Jinja string literal) + the
# prompt up to `<|im_end|>`; the prompt must be literal text (no Jinja expression inside).
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^{}'\"]*?)<\|im_end\|>")


class ChatMessageError(EdgeAgentError, ValueError):
    """A chat request whose messages cannot be rendered (caller error)."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class ChatTemplate:
    """A recognised ChatML template: marker ids, default system prompt, and a note for users."""

    im_start_id: int
    im_end_id: int
    default_system: str | None
    note: str = ""

    @classmethod
    def detect(
        cls, template: str | None, token_ids: Mapping[str, int], *, source: str = ""
    ) -> ChatTemplate | str:
        """The ChatTemplate for this model, or a string saying why there is none."""
        where = f"{source}: " if source else ""
        start, end = token_ids.get(IM_START), token_ids.get(IM_END)
        if start is None or end is None:
            return (
                f"{where}the vocabulary has no {IM_START} / {IM_END} tokens, so the model does "
                "not use ChatML, the only chat format edge-agent renders"
            )
        if not template:
            return cls(
                start, end, None,
                note="the model has no tokenizer.chat_template; using ChatML without a default "
                "system prompt",
            )
        if IM_START not in template or IM_END not in template:
            return (
                f"{where}tokenizer.chat_template is not ChatML (it never writes {IM_START} ... "
                f"{IM_END}); edge-agent renders only ChatML templates"
            )
        match = _DEFAULT_SYSTEM.search(template)
        if match is None:
            return cls(
                start, end, None,
                note="ChatML template without a literal default system prompt; none is added",
            )
        return cls(start, end, match.group(1))

    def encode(
        self,
        messages: Sequence[Mapping[str, str]],
        encode_text: Callable[[str], list[int]],
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of the rendered conversation (markers as special ids, text as plain text)."""
        checked = _check_messages(messages)
        ids: list[int] = []
        newline = encode_text("\n")

        def turn(role: str, content: str) -> None:
            ids.append(self.im_start_id)
            ids.extend(encode_text(f"{role}\n{content}"))
            ids.append(self.im_end_id)
            ids.extend(newline)

        if checked and checked[0][0] != "system" and self.default_system is not None:
            turn("system", self.default_system)
        for role, content in checked:
            turn(role, content)
        if add_generation_prompt:
            ids.append(self.im_start_id)
            ids.extend(encode_text("assistant\n"))
        return ids

    def render(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt as text (for display and logs; tokenize with `encode`, not this)."""
        checked = _check_messages(messages)
        parts: list[str] = []
        if checked and checked[0][0] != "system" and self.default_system is not None:
            parts.append(f"{IM_START}system\n{self.default_system}{IM_END}\n")
        parts.extend(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in checked)
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)


def _check_messages(messages: Sequence[Mapping[str, str]]) -> list[tuple[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatMessageError(
            f"chat messages must be a list of {{'role': ..., 'content': ...}} objects, got "
            f"{type(messages).__name__}. Hint: wrap a single prompt as "
            "[{'role': 'user', 'content': PROMPT}]."
        )
    out: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatMessageError(
                f"chat message #{i} is a {type(msg).__name__}, not an object with 'role' and "
                "'content'. Hint: send {'role': 'user', 'content': TEXT}."
            )
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role.strip() or "\n" in role:
            raise ChatMessageError(
                f"chat message #{i}: 'role' must be a non-empty one-line string, got {role!r}. "
                "Hint: use 'system', 'user' or 'assistant'."
            )
        if not isinstance(content, str):
            raise ChatMessageError(
                f"chat message #{i} (role {role!r}): 'content' must be a string, got "
                f"{type(content).__name__}. Hint: send the message text as a JSON string."
            )
        out.append((role, content))
    return out


def require_chatml(found: ChatTemplate | str) -> ChatTemplate:
    """The template, or ModelFileError carrying the reason `detect` gave."""
    if isinstance(found, ChatTemplate):
        return found
    raise ModelFileError(
        f"{found}. Hint: send a plain prompt (no chat template), or use a ChatML model "
        "such as the default SmolLM2."
    )
