"""Sentence embeddings: the llama.cpp engine's `embed` against llama-cpp-python's own
`Llama.embed` (the oracle: llama.cpp's pooling, in one decode), and POST /v1/embeddings of a
live daemon through the official `openai` SDK over the Unix socket.

Engine level: SmolLM2 (no pooling type of its own) with each pooling override, Gemma 3 (a
sliding-window model, inputs longer than the embedding context's decode), a tiny random-weight
GGUF that declares its pooling type; a model with no pooling and no override refused.
Daemon level (recipe as tests/test_daemon_openai.py): string, list and token-id inputs, base64
equal to float, usage counted, bad inputs 400 naming the field, a model that pools nothing and
the numpy engine refused, and a generation running beside embeddings unchanged.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_proc import Daemon, launch, serve_argv
from tiny_archs import write_tiny_arch

from edge_agent.paths import default_model_path
from edge_agent.runtime.engines import embed_batch_tokens, llamacpp_embed_bytes, model_facts

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python")
from edge_agent.runtime.llamacpp import LlamaCppEngine, LlamaCppError  # noqa: E402

POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}  # llama_pooling_type
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 30, "a"]
TOL = 1e-5  # the vectors are unit length; llama.cpp's own pooling of the same states


def _reference(path: Path, pooling: str | None, texts: list[str]) -> np.ndarray:
    """llama-cpp-python's embed() of each text alone (None: the model's own pooling)."""
    kind = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED if pooling is None else POOLING_TYPES[pooling]
    ref = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=kind, n_ctx=512,
                          n_threads=2, verbose=False)
    try:
        return np.array([ref.embed(t, normalize=True) for t in texts])
    finally:
        ref.close()


def _ours(engine: LlamaCppEngine, texts: list[str]) -> np.ndarray:
    ids = [engine.tokenizer.tokenize(t, add_bos=True, parse_special=False) for t in texts]
    assert max(len(i) for i in ids) > 2 * engine.embed_batch  # crosses decode boundaries
    return engine.embed(ids)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_engine_vectors_equal_llama_cpp_python(model_path: Path, pooling: str) -> None:
    with LlamaCppEngine(model_path, max_batch=2, context=512, threads=2,
                        pooling=pooling) as engine:
        assert engine.describe()["pooling"] == pooling
        ours = _ours(engine, TEXTS)
    ref = _reference(model_path, pooling, TEXTS)
    assert ours.shape == ref.shape == (3, 576)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert np.abs(ours - ref).max() < TOL, np.abs(ours - ref).max(axis=1)


def test_engine_gemma_sliding_window_mean(gemma_path: Path) -> None:
    texts = ["Edge boards run small models. " * 30, "short"]  # > one sliding window chunk
    with LlamaCppEngine(gemma_path, max_batch=2, context=512, threads=2,
                        pooling="mean") as engine:
        ours = _ours(engine, texts)
    assert np.abs(ours - _reference(gemma_path, "mean", texts)).max() < TOL


def test_engine_generation_is_untouched_by_embed(model_path: Path) -> None:
    """An embedding between two steps changes no running sequence's tokens."""
    from edge_agent.runtime.sampling import SamplingParams

    prompt = [1, 504, 3458, 282, 253, 1345]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LlamaCppEngine(model_path, max_batch=2, context=256, threads=2,
                        pooling="mean") as engine:
        solo = list(engine.generate(prompt, params))
        first = engine.add("s", prompt, params)
        tokens = [first]
        for _ in range(len(solo) - 1):
            engine.embed([list(range(100, 180))])
            tokens.append(engine.step(["s"])["s"])
        engine.release("s")
    assert tokens == solo


@pytest.mark.parametrize(("arch", "pooling"), [("llama", "last"), ("gemma3", "mean")])
def test_tiny_gguf_declaring_its_pooling(tmp_path: Path, arch: str, pooling: str) -> None:
    path = write_tiny_arch(tmp_path / f"{arch}.gguf", arch, pooling=pooling)
    facts = model_facts(path)
    assert facts.pooling_type == POOLING_TYPES[pooling] and facts.embedding_length == 64
    texts = ["tiny models " * 150, "x"]
    with LlamaCppEngine(path, max_batch=2, context=512, threads=2) as engine:  # "model"
        assert engine.pooling == pooling
        ours = _ours(engine, texts)
    assert np.abs(ours - _reference(path, None, texts)).max() < TOL


def test_model_without_pooling_is_refused(model_path: Path) -> None:
    assert model_facts(model_path).pooling_type == -1
    with LlamaCppEngine(model_path, max_batch=1, context=64, threads=2) as engine:
        assert engine.pooling is None
        with pytest.raises(LlamaCppError, match="declares no pooling type.*Hint: .*pooling"):
            engine.embed([[1, 2, 3]])
        assert engine._embed_ctx is None  # nothing allocated for it


def test_embed_refuses_bad_inputs(model_path: Path) -> None:
    with LlamaCppEngine(model_path, max_batch=1, context=64, threads=2,
                        pooling="mean") as engine:
        for bad, what in (([[]], "input 0 has no tokens"),
                          ([[1], list(range(65))], "input 1 has 65 tokens; the context is 64"),
                          ([[1, 10**7]], "token id 10000000 outside the vocabulary")):
            with pytest.raises(LlamaCppError, match=what):
                engine.embed(bad)


def test_embedding_context_is_in_the_budget(model_path: Path) -> None:
    facts = model_facts(model_path)
    extra = llamacpp_embed_bytes(facts, 512)
    assert embed_batch_tokens(facts.vocab_size) == 128  # SmolLM2: 49,152 tokens
    assert embed_batch_tokens(262_144) == 32  # Gemma 3
    assert extra >= facts.kv_bytes(512) + 2 * 128 * 4 * facts.vocab_size


# ---- the daemon ---------------------------------------------------------------------------------

CONTEXT = 256


def _httpx_module() -> Any:
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def _config(root: Path, engine: str, models: str) -> Path:
    cfg = root / "config.toml"
    cfg.write_text(
        f'[server]\nsocket = "{root / "ea.sock"}"\nstate_dir = "{root / "state"}"\n'
        "drain_timeout_s = 5\n"
        f'[runtime]\nengine = "{engine}"\nthreads = 2\n' + models)
    return cfg


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="ea-emb-", dir="/tmp"))
    cfg = _config(root, "llamacpp", (
        f'[models.smollm2]\ncontext = {CONTEXT}\nmax_batch = 2\npooling = "mean"\n'
        f'[models.plain]\npath = "{default_model_path()}"\ncontext = {CONTEXT}\n'
        "max_batch = 1\n"))
    with launch(Daemon, root, serve_argv(cfg)) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Any]:
    import openai

    transport = _httpx_module().HTTPTransport(uds=str(daemon.sock))
    c = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                      timeout=240, http_client=openai.DefaultHttpxClient(transport=transport))
    yield c
    c.close()


def _tokens(daemon: Daemon, text: str) -> list[int]:
    status, r = daemon.json("POST", "/tokenize", {"content": text, "add_special": True,
                                                  "parse_special": False})
    assert status == 200, r
    return [int(t) for t in r["tokens"]]


def _bad_request(client: Any, **kw: Any) -> Any:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(**kw)
    assert e.value.status_code == 400
    return e.value


@pytest.mark.slow
def test_string_input_loads_the_model_and_equals_the_engine(
        daemon: Daemon, client: Any, model_path: Path) -> None:
    assert daemon.health()["models"]["smollm2"]["state"] == "unloaded"  # loaded on demand
    text = "The quick brown fox jumps over the lazy dog. " * 15  # ~150 tokens, two decodes
    r = client.embeddings.create(model="smollm2", input=text, encoding_format="float")
    assert r.object == "list" and r.model == "smollm2" and len(r.data) == 1
    vec = np.array(r.data[0].embedding)
    assert vec.shape == (576,) and r.data[0].index == 0
    assert np.abs(vec - _reference(model_path, "mean", [text])[0]).max() < TOL
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(_tokens(daemon, text)) > 128
    assert daemon.health()["models"]["smollm2"]["engine_info"]["pooling"] == "mean"


@pytest.mark.slow
def test_list_input_base64_equals_float_and_usage_counts(daemon: Daemon, client: Any) -> None:
    texts = ["first text", "a second, somewhat longer text to embed", "third"]
    floats = client.embeddings.create(model="smollm2", input=texts, encoding_format="float")
    b64 = client.embeddings.create(model="smollm2", input=texts)  # the SDK asks for base64
    assert [d.index for d in floats.data] == [0, 1, 2]
    for f, b in zip(floats.data, b64.data, strict=True):
        assert f.embedding == b.embedding  # float32 both ways: identical
    assert floats.usage.prompt_tokens == sum(len(_tokens(daemon, t)) for t in texts)
    alone = client.embeddings.create(model="smollm2", input=texts[1], encoding_format="float")
    assert np.abs(np.array(alone.data[0].embedding)
                  - np.array(floats.data[1].embedding)).max() < TOL


@pytest.mark.slow
def test_token_id_inputs_equal_their_text(daemon: Daemon, client: Any) -> None:
    texts = ["tokens in", "tokens out again"]
    ids = [_tokens(daemon, t) for t in texts]
    by_text = client.embeddings.create(model="smollm2", input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model="smollm2", input=ids, encoding_format="float")
    one = client.embeddings.create(model="smollm2", input=ids[0], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert np.abs(np.array(a.embedding) - np.array(b.embedding)).max() < TOL
    assert np.abs(np.array(one.data[0].embedding)
                  - np.array(by_text.data[0].embedding)).max() < TOL
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)


@pytest.mark.slow
def test_dimensions_equal_to_the_model_is_accepted(client: Any) -> None:
    r = client.embeddings.create(model="smollm2", input="x", dimensions=576, user="someone",
                                 encoding_format="float")
    assert len(r.data[0].embedding) == 576


@pytest.mark.slow
@pytest.mark.parametrize(("kw", "param", "words"), [
    ({"input": []}, "input", "empty list"),
    ({"input": ["ok", ""]}, "input[1]", "empty string"),
    ({"input": ["ok", "word " * 400]}, "input[1]", f"more than the context of {CONTEXT}"),
    ({"input": "word " * 400}, "input", "input 0 is"),
    ({"input": [[1, 2], [3, 10**7]]}, "input[1][1]", "outside the vocabulary"),
    ({"input": ["ok", [1, 2]]}, "input[1]", "not a mix"),
    ({"input": [1, "a"]}, "input[1]", 'expected a token id like input[0], got "a"'),
    ({"input": "x", "dimensions": 64}, "dimensions", "gives vectors of 576"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
])
def test_bad_inputs_are_400_naming_the_field(client: Any, kw: dict[str, Any], param: str,
                                             words: str) -> None:
    err = _bad_request(client, model="smollm2", **kw)
    assert err.param == param, err.body
    assert words in err.message and "Hint:" in err.message, err.message


@pytest.mark.slow
def test_unknown_field_and_unknown_model(daemon: Daemon) -> None:
    status, r = daemon.json("POST", "/v1/embeddings", {"input": "x", "pooling": "mean"})
    assert status == 400 and r["error"]["code"] == "unknown_parameter", r
    assert r["error"]["param"] == "pooling"
    status, r = daemon.json("POST", "/v1/embeddings", {"input": "x", "model": "nope"})
    assert status == 404 and r["error"]["code"] == "model_not_found", r


@pytest.mark.slow
def test_a_model_without_pooling_is_refused_before_loading(daemon: Daemon, client: Any) -> None:
    err = _bad_request(client, model="plain", input="hello")
    assert err.param == "model" and err.code == "model_not_embedding"
    assert "'plain' declares no pooling type" in err.message
    assert 'models.plain.pooling = "mean"' in err.message
    assert daemon.health()["models"]["plain"]["state"] == "unloaded"


@pytest.mark.slow
def test_generation_beside_embeddings_is_unchanged(client: Any) -> None:
    msgs = [{"role": "user", "content": "Name three colors."}]

    def chat() -> str:
        r = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0,
                                           max_tokens=24, extra_body={"timeout_ms": 600_000})
        return r.choices[0].message.content

    solo = chat()
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(chat()))
    t.start()
    r = client.embeddings.create(model="smollm2", input=["many words to embed here " * 30] * 6,
                                 encoding_format="float")
    t.join(timeout=240)
    assert got == [solo]
    assert len(r.data) == 6 and r.usage.prompt_tokens > 512  # several runner messages


@pytest.mark.slow
def test_numpy_engine_is_refused() -> None:
    root = Path(tempfile.mkdtemp(prefix="ea-embn-", dir="/tmp"))
    cfg = _config(root, "numpy", "[models.smollm2]\ncontext = 64\n")
    with launch(Daemon, root, serve_argv(cfg)) as d:
        status, r = d.json("POST", "/v1/embeddings", {"input": "hello"})
    assert status == 400, r
    assert r["error"]["param"] == "model" and r["error"]["code"] == "model_not_embedding"
    assert "engine numpy computes no embeddings" in r["error"]["message"]
    assert "Hint: use the llamacpp engine" in r["error"]["message"]
