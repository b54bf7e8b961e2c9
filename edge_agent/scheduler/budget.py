"""Memory budgets and eviction decisions, computed before any load (never load and hope).

Invariants owned here:
- A model's budget is its prepared weights plus a KV pool for `max_batch` sequences of `context`
  tokens: weight_bytes + 2 (K and V) x n_layers x n_kv_heads x head_dim x max_batch x context x
  dtype_bytes, plus `overhead_bytes` for the runner process itself (the daemon passes
  RUNNER_BASE_BYTES). Exact integer arithmetic. The daemon uses this one number both for load
  planning and as the base of the model group's cgroup memory.high / memory.max.
- `plan_load` evicts only idle models (busy ones are never chosen), least recently used first
  (ties by name, so the plan is deterministic), and only as many as needed for
  used - evicted + need <= limit. When even evicting every idle model is not enough it raises
  BudgetExceeded with the numbers and evicts nothing.
- A model already in `loaded` needs nothing: the plan is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edge_agent.errors import ConfigError
from edge_agent.scheduler.errors import BudgetExceeded

__all__ = ["LoadedModel", "model_budget_bytes", "plan_load", "format_bytes",
           "RUNNER_BASE_BYTES"]

# Memory of a runner process besides its weights and KV cache: the interpreter, numpy and the
# tokenizer. Measured on a runner with a 13 MB model loaded: ~60 MiB anon + ~35 MiB shmem
# (python + numpy + tokenizers ~ 95 MiB); rounded up to leave headroom for allocator slack.
RUNNER_BASE_BYTES = 128 << 20


@dataclass(frozen=True)
class LoadedModel:
    """A resident model as the budget sees it."""

    name: str
    bytes: int
    last_used: float
    busy: bool


def model_budget_bytes(
    weight_bytes: int,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    max_batch: int,
    context: int,
    dtype_bytes: int = 4,
    overhead_bytes: int = 0,
) -> int:
    """Bytes a model needs resident: weights + K and V for max_batch x context tokens, plus
    `overhead_bytes` for the process that holds them (RUNNER_BASE_BYTES for a runner)."""
    args = {
        "weight_bytes": (weight_bytes, 0),
        "n_layers": (n_layers, 1),
        "n_kv_heads": (n_kv_heads, 1),
        "head_dim": (head_dim, 1),
        "max_batch": (max_batch, 1),
        "context": (context, 1),
        "dtype_bytes": (dtype_bytes, 1),
        "overhead_bytes": (overhead_bytes, 0),
    }
    for key, (value, minimum) in args.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(
                f"model_budget_bytes: {key}={value!r}, expected an integer >= {minimum}. "
                "Hint: read these from the model's GGUF metadata and its [models.NAME] table."
            )
    kv = 2 * n_layers * n_kv_heads * head_dim * max_batch * context * dtype_bytes
    return weight_bytes + kv + overhead_bytes


def plan_load(
    name: str, need_bytes: int, limit_bytes: int, loaded: Sequence[LoadedModel]
) -> list[str]:
    """Names of idle models to unload (LRU first) so that `name` fits; [] when it fits as is."""
    if any(m.name == name for m in loaded):
        return []
    used = sum(m.bytes for m in loaded)
    if used + need_bytes <= limit_bytes:
        return []
    idle = sorted((m for m in loaded if not m.busy), key=lambda m: (m.last_used, m.name))
    evict: list[str] = []
    freed = 0
    for model in idle:
        evict.append(model.name)
        freed += model.bytes
        if used - freed + need_bytes <= limit_bytes:
            return evict
    evictable = sum(m.bytes for m in idle)
    busy = [m for m in loaded if m.busy]
    if need_bytes > limit_bytes:
        why = "more than the whole limit, even with nothing else loaded"
        hint = (
            f"lower context or max_batch in [models.{name}], use dtype f16, or raise "
            "runtime.memory_budget_bytes / the service's MemoryMax"
        )
    else:
        busy_list = ", ".join(f"{m.name} {format_bytes(m.bytes)}" for m in busy) or "none"
        why = (
            f"{format_bytes(used)} is loaded and evicting every idle model frees only "
            f"{format_bytes(evictable)}; busy models: {busy_list}"
        )
        hint = (
            "retry when busy models finish, unload one (POST /v1/models/NAME/unload), "
            "or raise runtime.memory_budget_bytes / the service's MemoryMax"
        )
    raise BudgetExceeded(
        f"load model {name!r}: needs {format_bytes(need_bytes)} but the memory limit is "
        f"{format_bytes(limit_bytes)}: {why}. Hint: {hint}.",
        model=name,
        need_bytes=need_bytes,
        limit_bytes=limit_bytes,
        used_bytes=used,
        evictable_bytes=evictable,
    )


def format_bytes(n: int) -> str:
    """`1,234,567 bytes (1.2 MiB)`: exact count, then a readable size."""
    size = float(n)
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    readable = f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
    return f"{n:,} bytes ({readable})"
