"""The numpy forward against transformers' logits (tests/data/reference_logits.json).

f32 weights, prefill of the prompt, then 15 teacher-forced decode steps fed the reference's
greedy tokens: every compared logit within 1e-3 (max abs); greedy 32-token continuations equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import ModelFileError
from edge_agent.runtime.engine import Engine, greedy_ids
from edge_agent.runtime.kvcache import BlockTable
from edge_agent.runtime.model import Llama, ModelConfig

PROMPTS = ("chat_capital", "story", "code")
TOL = 1e-3


def _compare(name: str, rows: np.ndarray, ref: dict[str, np.ndarray]) -> float:
    """Max abs difference of our rows (R, V) against every stored part of the reference."""
    worst = 0.0
    sample = ref[f"{name}__sample"]
    stride = rows.shape[1] // sample.shape[1]
    worst = max(worst, float(np.abs(rows[:, ::stride] - sample).max()))
    top_ids, top_vals = ref[f"{name}__top_ids"], ref[f"{name}__top_vals"]
    worst = max(worst, float(np.abs(np.take_along_axis(rows, top_ids, axis=1) - top_vals).max()))
    full_rows = ref[f"{name}__full_rows"]
    worst = max(worst, float(np.abs(rows[full_rows] - ref[f"{name}__full"]).max()))
    # the reference's argmax is ours too (the top-1 gap exceeds the tolerance on these rows)
    assert (rows.argmax(axis=1) == top_ids[:, 0]).all()
    return worst


@pytest.mark.parametrize("name", PROMPTS)
def test_prefill_and_16_decode_steps_match_reference(name, llama_f32, reference_logits):
    ref = reference_logits
    ids = ref[f"{name}__input_ids"].tolist()
    gen = ref[f"{name}__generated_ids"].tolist()
    pool = llama_f32.new_pool(8)
    table = BlockTable()
    prompt = llama_f32.prefill(ids, table, pool, all_logits=True)  # (T, V)
    steps = [llama_f32.decode([gen[i]], [table], pool)[0] for i in range(15)]
    rows = np.concatenate([prompt[-4:], np.stack(steps)])  # (19, V)
    assert table.length == len(ids) + 15
    worst = _compare(name, rows, ref)
    assert worst < TOL, f"{name}: max abs logit difference {worst:.2e} >= {TOL}"


def test_128_token_prompt_matches_reference(llama_f32, reference_logits):
    ids = reference_logits["long128__input_ids"].tolist()
    assert len(ids) == 128
    pool = llama_f32.new_pool(8)
    rows = llama_f32.prefill(ids, BlockTable(), pool, all_logits=True)[-4:]  # (4, V)
    worst = _compare("long128", rows, reference_logits)
    assert worst < TOL, f"long128: max abs logit difference {worst:.2e} >= {TOL}"


def test_greedy_32_token_continuations_are_identical(llama_f32, reference_logits):
    engine = Engine(llama_f32, max_batch=1, context=96)
    for name in PROMPTS:
        ids = reference_logits[f"{name}__input_ids"].tolist()
        expected = reference_logits[f"{name}__generated_ids"].tolist()
        assert greedy_ids(engine, ids, 32) == expected, name
    assert engine.free_blocks == engine.pool.n_blocks


def test_config_from_default_model(model_config):
    assert (model_config.n_layers, model_config.dim, model_config.ffn_dim) == (30, 576, 1536)
    assert (model_config.n_heads, model_config.n_kv_heads, model_config.head_dim) == (9, 3, 64)
    assert model_config.rope_base == 100000.0 and model_config.vocab_size == 49152
    assert model_config.context_length == 8192
    assert abs(model_config.rms_eps - 1e-5) < 1e-9


def test_default_model_head_is_tied(llama_f32):
    assert llama_f32.tied and llama_f32.output is llama_f32.token_embd


# -- bad input, on a tiny random model ------------------------------------------------------

TINY = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.embedding_length": 16,
    "llama.feed_forward_length": 24,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.rope.freq_base": 10000.0,
    "llama.context_length": 64,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 40,
}


def _tiny_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: (rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.1) + (
            1.0 if len(shape) == 1 else 0.0)).astype(np.float32)
        for name, shape in config.tensor_shapes(tied=True).items()
    }


def test_unsupported_architecture_is_refused():
    with pytest.raises(ModelFileError) as exc:
        ModelConfig.from_metadata({**TINY, "general.architecture": "gpt2"}, source="m.gguf")
    msg = str(exc.value)
    assert "m.gguf" in msg and "'gpt2'" in msg and "not supported" in msg and "Hint:" in msg


def test_missing_metadata_key_is_named():
    meta = dict(TINY)
    del meta["llama.block_count"]
    with pytest.raises(ModelFileError, match=r"m\.gguf: metadata key 'llama\.block_count' is "
                       r"missing.*Hint:"):
        ModelConfig.from_metadata(meta, source="m.gguf")


def test_bad_head_counts_and_rope_variants_are_refused():
    meta = {**TINY, "llama.attention.head_count_kv": 3, "llama.rope.dimension_count": 2,
            "llama.rope.scaling.type": "yarn"}
    with pytest.raises(ModelFileError) as exc:
        ModelConfig.from_metadata(meta, source="m.gguf")
    msg = str(exc.value)
    assert "not a multiple of head_count_kv 3" in msg
    assert "rope.dimension_count 2 != head_dim 4" in msg
    assert "'yarn'" in msg and "Hint:" in msg


def test_tensor_shape_mismatch_names_tensor_and_shapes():
    config = ModelConfig.from_metadata(TINY)
    tensors = _tiny_tensors(config)
    tensors["blk.1.attn_k.weight"] = np.zeros((16, 16), np.float32)
    with pytest.raises(ModelFileError) as exc:
        Llama(config, tensors, source="p.weights")
    assert str(exc.value).startswith(
        "p.weights: tensor 'blk.1.attn_k.weight' has shape (16, 16), expected (8, 16)"
    )


def test_missing_tensor_and_wrong_dtype_are_named():
    config = ModelConfig.from_metadata(TINY)
    tensors = _tiny_tensors(config)
    del tensors["blk.0.ffn_up.weight"]
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.0\.ffn_up\.weight' is missing"):
        Llama(config, tensors)
    tensors = _tiny_tensors(config)
    tensors["token_embd.weight"] = tensors["token_embd.weight"].astype(np.float64)
    with pytest.raises(ModelFileError, match=r"'token_embd\.weight' has dtype float64.*Hint:"):
        Llama(config, tensors)


def test_separate_output_head_is_used_when_present():
    config = ModelConfig.from_metadata(TINY)
    tensors = _tiny_tensors(config)
    tied = Llama(config, tensors)
    untied = Llama(config, {**tensors, "output.weight": 2 * tensors["token_embd.weight"]})
    assert not untied.tied
    ids = [3, 1, 4, 1, 5]
    a = tied.prefill(ids, BlockTable(), tied.new_pool(2))
    b = untied.prefill(ids, BlockTable(), untied.new_pool(2))
    np.testing.assert_allclose(b, 2 * a, rtol=1e-5, atol=1e-6)


def test_f16_weights_give_close_logits():
    config = ModelConfig.from_metadata(TINY)
    tensors = _tiny_tensors(config)
    half = {k: (v.astype(np.float16) if v.ndim > 1 else v) for k, v in tensors.items()}
    ids = [7, 8, 9, 10]
    a = Llama(config, tensors).prefill(ids, BlockTable(), Llama(config, tensors).new_pool(2))
    m16 = Llama(config, half)
    b = m16.prefill(ids, BlockTable(), m16.new_pool(2))
    assert np.abs(a - b).max() < 0.05
    assert not np.array_equal(a, b)


def test_chunked_prefill_equals_one_pass(llama_f32, reference_logits):
    ids = reference_logits["long128__input_ids"].tolist()
    one = llama_f32.prefill(ids, BlockTable(), llama_f32.new_pool(8), all_logits=True)
    table = BlockTable()
    pool = llama_f32.new_pool(8)
    chunked = llama_f32.prefill(ids, table, pool, all_logits=True, chunk=48)  # 48+48+32
    assert chunked.shape == one.shape == (128, 49152) and table.length == 128
    assert np.abs(chunked - one).max() < 1e-4
    last = llama_f32.prefill(ids, BlockTable(), llama_f32.new_pool(8), chunk=100)
    assert np.abs(last - one[-1]).max() < 1e-4
