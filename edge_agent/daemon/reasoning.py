"""A thinking model's reasoning, kept apart from its answer (OpenAI `reasoning_content`, Ollama
`thinking`).

Invariants owned here:
- A model thinks when its chat template speaks of `</think>` (DeepSeek-R1 distills, Qwen3,
  QwQ, ...). Its reply is parsed only for chat requests that are not constrained (a grammar
  decides every token from the first, so there is no thought to find) and that did not ask
  for the raw text (`reasoning_format: "none"`); `thought_start` says whether and how.
- A reply is a thought when its prompt ends inside one (the template wrote `<think>`) or when
  its first non-blank text is `<think>`; the thought runs to `</think>` or to the end of the
  reply. Reasoning is the thought without its tags and the whitespace around it; the answer is
  what follows `</think>`, its leading whitespace dropped. A reply that opens no thought is all
  answer, as it came.
- `ThinkGate` sends each piece of reasoning and answer as soon as it is known (a tail that
  could begin a tag, or whitespace that could end a thought, waits for what follows); what
  it sends, plus `end()`, is exactly `split_thought` of the whole reply. Its `done` is how much
  of the reply it has accounted for (the streams attach log-probabilities by it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from edge_agent.daemon.structured import Call, CallGate, held_tail, jinja_template
from edge_agent.protocol.api import GenerationRequest

if TYPE_CHECKING:
    from edge_agent.daemon.requests import RequestRecord

__all__ = ["OPEN", "CLOSE", "ReplyGate", "ThinkGate", "model_thinks", "reply_parts",
           "split_thought", "thought_of", "thought_start"]

OPEN, CLOSE = "<think>", "</think>"


def model_thinks(tok: Any) -> bool:
    """Whether the model's chat template speaks of thoughts (a Jinja template from the GGUF or
    models.NAME.chat_template_file; the numpy engine's ChatML never does)."""
    template = jinja_template(tok)
    return template is not None and (CLOSE in template.template
                                     or CLOSE in (template.tool_use_template or ""))


def thought_of(rec: RequestRecord, tok: Any) -> bool | None:
    """`thought_start` of an accepted request (`tok`: its model's vocabulary)."""
    return thought_start(rec.request, tok, rec.job.prompt_ids, rec.job.params)


def thought_start(req: GenerationRequest, tok: Any, prompt_ids: Sequence[int],
                  params: object) -> bool | None:
    """None: the reply is not parsed for a thought (not a chat, a model that does not think,
    a constrained request (`params` has a grammar), or `reasoning_format: "none"`); else
    whether the prompt ends inside a thought the template opened."""
    constrained = isinstance(params, Mapping) and "grammar" in params
    if not req.chat or req.reasoning_format == "none" or constrained or not model_thinks(tok):
        return None
    return bool(tok.detokenize(list(prompt_ids[-8:])).rstrip().endswith(OPEN))


class ThinkGate:
    """What of a reply a stream can send now, as reasoning and as answer (module docstring)."""

    def __init__(self, opened: bool) -> None:
        self.text = ""  # the reply so far
        self.done = 0  # characters of it accounted for (sent, or tags and whitespace dropped)
        self.state = "thought" if opened else "start"  # start | thought | answer
        self.thought = opened  # the reply has a thought (an empty one gives no reasoning)
        self.begun = False  # the thought's first non-blank character was sent
        self.answering = False  # the answer's first non-blank character was sent

    def feed(self, piece: str) -> tuple[str, str]:
        """Add the next piece of the reply; (reasoning, answer) that may be sent now."""
        self.text += piece
        reasoning = answer = ""
        if self.state == "start":
            body = self.text.lstrip()
            if len(body) < len(OPEN) and OPEN.startswith(body):
                return "", ""  # blank so far, or the beginning of <think>
            if body.startswith(OPEN):
                self.state, self.thought = "thought", True
                self.done = len(self.text) - len(body) + len(OPEN)
            else:
                self.state, self.answering = "answer", True  # no thought: the reply as it is
        if self.state == "thought":
            at = self.text.find(CLOSE, self.done)
            end = at if at >= 0 else len(self.text) - held_tail(self.text, CLOSE)
            part = self.text[self.done:end]
            if not self.begun:
                stripped = part.lstrip()
                self.done += len(part) - len(stripped)
                part, self.begun = stripped, bool(stripped)
            reasoning = part.rstrip()  # whitespace that may end the thought waits
            self.done += len(reasoning)
            if at >= 0:
                self.state, self.done = "answer", at + len(CLOSE)
        if self.state == "answer":
            part = self.text[self.done:]
            if not self.answering:
                stripped = part.lstrip()
                self.done += len(part) - len(stripped)
                part, self.answering = stripped, bool(stripped)
            answer = part
            self.done += len(part)
        return reasoning, answer

    def end(self) -> tuple[str, str]:
        """At the end of the reply: the reasoning and answer still held back."""
        rest = self.text[self.done:]
        self.done = len(self.text)
        if self.state == "start":
            return "", rest  # blank, or an unfinished "<thi": answer text as it came
        if self.state == "thought":  # a thought the reply never closed
            return (rest.rstrip() if self.begun else rest.strip()), ""
        return "", ""


def split_thought(text: str, opened: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole reply; reasoning None when it has no thought, or an
    empty one."""
    gate = ThinkGate(opened)
    r1, a1 = gate.feed(text)
    r2, a2 = gate.end()
    reasoning = r1 + r2
    return (reasoning if gate.thought and reasoning else None), a1 + a2


def reply_parts(text: str, thought: bool | None) -> tuple[str | None, str]:
    """(reasoning, answer) of a reply whose thought starts as `thought_start` said (None: the
    reply is not parsed: no reasoning, the answer is the text)."""
    return (None, text) if thought is None else split_thought(text, thought)


class ReplyGate:
    """What of a reply a stream can send now: reasoning (when the reply is parsed for a
    thought), and answer text, read by a `structured.CallGate` when the answer may call tools
    (`names`: the functions it may call; its calls' parts come from `take`). `sent` is how much
    of the reply is accounted for."""

    def __init__(self, thought: bool | None, names: Sequence[str] = ()) -> None:
        self.think = ThinkGate(thought) if thought is not None else None
        self.call = CallGate(names) if names else None
        self.text = ""  # the reply so far

    def feed(self, piece: str) -> tuple[str, str]:
        """Add the next piece; (reasoning, answer text) that may be sent now."""
        self.text += piece
        reasoning, answer = self.think.feed(piece) if self.think is not None else ("", piece)
        if self.call is not None:
            answer = self.call.feed(answer)
        return reasoning, answer

    def take(self) -> list[tuple[int, str | None, str]]:
        """The calls' parts found since the last take (`CallGate.take`)."""
        return self.call.take() if self.call is not None else []

    @property
    def calls(self) -> list[Call]:
        """The calls the answer made so far."""
        return self.call.calls if self.call is not None else []

    @property
    def sent(self) -> int:
        done = self.think.done if self.think is not None else len(self.text)
        if self.call is not None:
            done -= len(self.call.text) - self.call.sent  # answer the call gate still holds
        return done

    def rest(self) -> tuple[str, str]:
        """At the end: the reasoning and answer text still to send (the last calls' parts
        then come from `take`)."""
        reasoning, answer = self.think.end() if self.think is not None else ("", "")
        if self.call is not None:
            answer = self.call.feed(answer) + self.call.end()
        return reasoning, answer
