"""Which new sequences share a prefill forward: groups of similar prompt length.

Invariants this module owns:
- Every prompt is in exactly one group; a group's prompts are in ascending length order.
- A prompt joins the current group only while the padding it adds (its length minus the
  group's longest so far, times the group's size) stays within _PAD_BUDGET rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edge_agent.runtime.sampling_params import SamplingParams

__all__ = ["NewSeq", "prefill_groups"]


@dataclass(frozen=True)
class NewSeq:
    """A sequence for `Engine.add_many`: its id, prompt, sampling and already generated ids."""

    seq_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    generated: Sequence[int] = ()


# Prompts prefilled together are padded to the group's longest. A forward's fixed cost (the
# weights streamed once) is worth about this many prompt tokens here (a batch-1 decode step
# ~55 ms, each further prompt row ~2.6 ms, thread CPU time): a prompt joins the group while the
# padding it adds stays below that.
_PAD_BUDGET = 16


def prefill_groups(ready: list[tuple[NewSeq, list[int]]]) -> list[list[tuple[NewSeq, list[int]]]]:
    """Split prompts, by length, into groups whose padding costs less than separate forwards."""
    groups: list[list[tuple[NewSeq, list[int]]]] = []
    for item in sorted(ready, key=lambda it: len(it[1])):
        cur = groups[-1] if groups else None
        if cur is not None and (len(item[1]) - len(cur[-1][1])) * len(cur) <= _PAD_BUDGET:
            cur.append(item)
        else:
            groups.append([item])
    return groups
