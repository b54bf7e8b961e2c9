"""Memory budget arithmetic and LRU eviction plans."""

from __future__ import annotations

import random

import pytest

from edge_agent.cgroup import load_policy
from edge_agent.errors import ConfigError, EdgeAgentError
from edge_agent.scheduler import (
    RUNNER_BASE_BYTES,
    BudgetExceeded,
    LoadedModel,
    format_bytes,
    model_budget_bytes,
    plan_load,
)

MiB = 1 << 20
# SmolLM2-135M's prepared f32 weights: 538,060,032 bytes; 30 layers, 3 KV heads, head_dim 64.
SMOL_F32 = 538_060_032


def test_budget_of_the_default_model() -> None:
    # KV: 2 (K,V) x 30 layers x 3 heads x 64 dims x 8 seqs x 8192 tokens x 4 bytes
    assert 2 * 30 * 3 * 64 * 8 * 8192 * 4 == 3_019_898_880
    assert model_budget_bytes(SMOL_F32, 30, 3, 64, 8, 8192) == 3_557_958_912
    assert model_budget_bytes(SMOL_F32, 30, 3, 64, 8, 2048) == SMOL_F32 + 754_974_720
    assert model_budget_bytes(SMOL_F32, 30, 3, 64, 8, 2048, dtype_bytes=2) == (
        SMOL_F32 + 377_487_360
    )
    assert model_budget_bytes(0, 1, 1, 1, 1, 1, 1) == 2


@pytest.mark.parametrize(
    ("index", "value", "key"),
    [
        (0, -1, "weight_bytes"),
        (1, 0, "n_layers"),
        (2, 0, "n_kv_heads"),
        (3, 1.5, "head_dim"),
        (4, 0, "max_batch"),
        (5, True, "context"),
        (6, 0, "dtype_bytes"),
    ],
)
def test_budget_rejects_bad_numbers(index: int, value: object, key: str) -> None:
    args: list[object] = [SMOL_F32, 30, 3, 64, 8, 2048, 4]
    args[index] = value
    expected = rf"model_budget_bytes: {key}=.*expected an integer.*Hint"
    with pytest.raises(ConfigError, match=expected):
        model_budget_bytes(*args)  # type: ignore[arg-type]  # on purpose: a bad value


def test_runner_overhead_is_in_the_budget_and_in_the_cgroup_limits() -> None:
    base = model_budget_bytes(13_000_000, 2, 1, 16, 1, 64)
    with_runner = model_budget_bytes(13_000_000, 2, 1, 16, 1, 64, overhead_bytes=RUNNER_BASE_BYTES)
    assert with_runner == base + RUNNER_BASE_BYTES == base + (128 << 20)
    with pytest.raises(ConfigError, match=r"overhead_bytes=-1, expected an integer >= 0.*Hint"):
        model_budget_bytes(13_000_000, 2, 1, 16, 1, 64, overhead_bytes=-1)
    # a 13 MB model: its runner needs ~95 MiB (python, numpy, tokenizer) besides the weights,
    # so the default policy must not throttle it (memory.high) below that
    limits = load_policy("default").model.limits(with_runner)
    high, mx = int(limits["memory.high"]), int(limits["memory.max"])
    assert high >= 1.15 * (13_000_000 + (128 << 20)) - 4096 > 95 * MiB + 13_000_000
    assert high <= mx
    without = int(load_policy("default").model.limits(base)["memory.high"])
    assert without < 20 * MiB  # what the daemon used to write: the runner stuck in loading


def lm(name: str, mib: int, last_used: float, busy: bool = False) -> LoadedModel:
    return LoadedModel(name=name, bytes=mib * MiB, last_used=last_used, busy=busy)


def test_fits_without_eviction() -> None:
    assert plan_load("new", 100 * MiB, 1000 * MiB, []) == []
    assert plan_load("new", 400 * MiB, 1000 * MiB, [lm("a", 600, 1.0)]) == []  # exactly full


def test_already_loaded_needs_nothing() -> None:
    assert plan_load("a", 900 * MiB, 1000 * MiB, [lm("a", 900, 1.0), lm("b", 100, 0.0)]) == []


def test_evicts_least_recently_used_idle_models_only_as_many_as_needed() -> None:
    loaded = [lm("old-busy", 300, 0.0, busy=True), lm("recent", 300, 9.0), lm("old", 300, 1.0),
              lm("middle", 100, 5.0)]
    # used 1000 of 1000; need 350: evict idle LRU: old (300) then middle (100) -> frees 400
    assert plan_load("new", 350 * MiB, 1000 * MiB, loaded) == ["old", "middle"]
    assert plan_load("new", 250 * MiB, 1000 * MiB, loaded) == ["old"]
    assert plan_load("new", 700 * MiB, 1000 * MiB, loaded) == ["old", "middle", "recent"]


def test_ties_are_broken_by_name() -> None:
    loaded = [lm("b", 100, 1.0), lm("a", 100, 1.0)]
    assert plan_load("n", 100 * MiB, 200 * MiB, loaded) == ["a"]


def test_refused_when_busy_models_hold_the_memory() -> None:
    loaded = [lm("busy", 700, 0.0, busy=True), lm("idle", 200, 5.0)]
    with pytest.raises(BudgetExceeded) as info:
        plan_load("new", 400 * MiB, 1000 * MiB, loaded)
    err = info.value
    assert issubclass(type(err), EdgeAgentError)
    assert (err.model, err.need_bytes, err.limit_bytes, err.used_bytes, err.evictable_bytes) == (
        "new", 400 * MiB, 1000 * MiB, 900 * MiB, 200 * MiB
    )
    msg = str(err)
    assert "load model 'new': needs 419,430,400 bytes (400.0 MiB)" in msg
    assert "memory limit is 1,048,576,000 bytes (1000.0 MiB)" in msg
    assert "943,718,400 bytes (900.0 MiB) is loaded" in msg
    assert "frees only 209,715,200 bytes (200.0 MiB)" in msg
    assert "busy models: busy 734,003,200 bytes (700.0 MiB)" in msg
    assert "Hint: retry when busy models finish" in msg


def test_refused_when_larger_than_the_whole_limit() -> None:
    need = model_budget_bytes(SMOL_F32, 30, 3, 64, 8, 8192)
    with pytest.raises(BudgetExceeded) as info:
        plan_load("smollm2", need, 2048 * MiB, [])
    msg = str(info.value)
    assert "needs 3,557,958,912 bytes (3.3 GiB)" in msg and "(2.0 GiB)" in msg
    assert "more than the whole limit, even with nothing else loaded" in msg
    assert "Hint: lower context or max_batch in [models.smollm2]" in msg


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 bytes (0 B)"
    assert format_bytes(1023) == "1,023 bytes (1023 B)"
    assert format_bytes(1536) == "1,536 bytes (1.5 KiB)"
    assert format_bytes(5 << 40) == "5,497,558,138,880 bytes (5.0 TiB)"
    assert format_bytes(5 << 50).endswith("(5120.0 TiB)")


@pytest.mark.parametrize("seed", range(5))
def test_random_plans_are_minimal_lru_prefixes_of_idle_models(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        loaded = [
            lm(f"m{i}", rng.randint(1, 500), float(rng.randint(0, 20)), rng.random() < 0.3)
            for i in range(rng.randint(0, 6))
        ]
        need = rng.randint(1, 1500) * MiB
        limit = rng.randint(100, 2000) * MiB
        used = sum(m.bytes for m in loaded)
        idle = sorted((m for m in loaded if not m.busy), key=lambda m: (m.last_used, m.name))
        try:
            plan = plan_load("new", need, limit, loaded)
        except BudgetExceeded as e:
            assert used - sum(m.bytes for m in idle) + need > limit  # truly cannot fit
            assert e.used_bytes == used and e.need_bytes == need
            continue
        assert plan == [m.name for m in idle[: len(plan)]]  # idle only, LRU order
        freed = sum(m.bytes for m in idle[: len(plan)])
        assert used - freed + need <= limit  # fits after the plan
        if plan:  # and one fewer eviction would not have been enough
            assert used - freed + idle[len(plan) - 1].bytes + need > limit
