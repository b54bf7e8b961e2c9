"""Cut the committed logits reference (tests/data/reference_logits.npz) out of the full one.

The full reference (`reference_logits_transformers.npz`, ~12.6 MB) comes from `transformers`
loading the default GGUF with f32 dequantization (torch CPU wheel; neither is a project
dependency, so that step is not scripted here). Its JSON sidecar describes it. This script keeps,
for each prompt, 19 logits rows: the last 4 prompt positions and decode steps 1..15 (step 0 is
the last prompt position again), as
  - `NAME__full` / `NAME__full_rows`: complete rows for a few positions,
  - `NAME__sample`: every 32nd vocabulary entry of every row,
  - `NAME__top_ids` / `NAME__top_vals`: the reference's 32 largest logits of every row,
plus input ids and the 32 greedy ids. About 2.3 MB.

Usage: python tests/data/reference_subset.py FULL.npz tests/data/reference_logits.npz
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["main", "PROMPTS", "SAMPLE_STRIDE", "TOP_K"]

PROMPTS = ("chat_capital", "story", "code")
SAMPLE_STRIDE = 32
TOP_K = 32
FULL_ROWS = (3, 4, 18)  # last prompt position, decode step 1, decode step 15


def _keep(out: dict[str, np.ndarray], name: str, rows: np.ndarray, full: tuple[int, ...]) -> None:
    out[f"{name}__full_rows"] = np.asarray(full, dtype=np.int32)
    out[f"{name}__full"] = rows[list(full)].astype(np.float32)
    out[f"{name}__sample"] = rows[:, ::SAMPLE_STRIDE].astype(np.float32)
    top = np.argsort(-rows, axis=1, kind="stable")[:, :TOP_K]
    out[f"{name}__top_ids"] = top.astype(np.int32)
    out[f"{name}__top_vals"] = np.take_along_axis(rows, top, axis=1).astype(np.float32)


def main(argv: list[str]) -> int:
    src, dst = argv
    z = np.load(src)
    out: dict[str, np.ndarray] = {}
    for name in PROMPTS:
        rows = np.concatenate(
            [z[f"{name}__prompt_logits_last4"], z[f"{name}__step_logits_16"][1:]]
        )  # (19, V)
        out[f"{name}__input_ids"] = z[f"{name}__input_ids"].astype(np.int32)
        out[f"{name}__generated_ids"] = z[f"{name}__generated_ids"].astype(np.int32)
        _keep(out, name, rows, FULL_ROWS)
    out["long128__input_ids"] = z["long128__input_ids"].astype(np.int32)
    _keep(out, "long128", z["long128__prompt_logits_last4"], (3,))
    np.savez_compressed(dst, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
