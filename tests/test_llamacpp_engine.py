"""The llama.cpp engine on the two shipped models: SmolLM2-135M (Q4_1, llama) and Gemma 3 270M
(Q4_K_M, gemma3, SentencePiece vocabulary).

Oracles: llama.cpp's own greedy decoding through llama-cpp-python's high-level `Llama` (its
sampler chain, its tokenizer, its batch of one): our engine drives the same kernels through the
low-level API and samples with our own sampler, so at temperature 0 both must produce the same
token ids. The transformers reference stays the numpy engine's oracle (llama.cpp quantizes
activations to 8 bits, so the two differ at near-ties). Batch invariance is measured, never
assumed: where the engine says a model is invariant, the same prompts alone and in a batch of 8
give identical tokens, and so does a resume by prefill.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import interrupt
import pytest

from edge_agent.errors import EdgeAgentError, ModelFileError
from edge_agent.paths import default_model_path
from edge_agent.runtime.prefill_groups import NewSeq
from edge_agent.runtime.sampling import SamplingParams

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs llama-cpp-python")

from edge_agent.runtime.llamacpp import LlamaCppEngine, LlamaCppError  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3, 4,",
           "The meaning of life is", "Water boils at", "In 1492,", "My favourite colour is"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


MODELS = ["smollm2", "gemma3"]


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> Path:
    if request.param == "smollm2":
        return default_model_path()
    return Path(request.getfixturevalue("gemma_path"))


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[LlamaCppEngine]:
    e = LlamaCppEngine.load(model, max_batch=8, context=256, mlock="best-effort", threads=2)
    try:
        yield e
    finally:
        e.close()


def _own_greedy(path: Path, prompt: str, n: int) -> list[int]:
    """llama.cpp's own greedy ids for `prompt` (high-level API: its tokenizer, its sampler),
    with llama-server's attention settings (flash attention on CPU, a window-sized SWA cache);
    the high-level API's default (no flash attention) is another kernel: near-ties differ."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False,
                          flash_attn=True, swa_full=False)
    try:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        out: list[int] = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0):
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or len(out) >= n:
                break
            out.append(int(tok))
        return out
    finally:
        llm.close()


def test_greedy_equals_llama_cpp_own_greedy(engine: LlamaCppEngine, model: Path) -> None:
    for prompt in PROMPTS[:3]:
        ours = list(engine.generate(engine.tokenizer.encode(prompt), GREEDY))
        assert ours, prompt
        assert ours == _own_greedy(model, prompt, len(ours)), prompt


def test_describe_names_architecture_and_vocabulary(engine: LlamaCppEngine, model: Path) -> None:
    d = engine.describe()
    assert d["engine"] == "llamacpp"
    if model == default_model_path():
        assert (d["architecture"], d["vocab_type"], d["vocab_size"]) == ("llama", "bpe", 49152)
    else:
        assert (d["architecture"], d["vocab_type"], d["vocab_size"]) == ("gemma3", "spm", 262144)
    assert d["weight_bytes"] > 50 << 20 and d["parameters"] > 100_000_000


def test_weights_pinned_vmlck_covers_them(engine: LlamaCppEngine) -> None:
    report = engine.lock_report()
    assert report is not None and report["policy"] == "best-effort"
    if not report["locked"]:
        pytest.skip(f"mlock refused here: {report['error']}")
    assert report["vmlck_bytes"] >= report["weight_bytes"]
    assert report["locked_bytes"] >= report["weight_bytes"]


def test_lock_summary_times_llamacpps_load_not_a_populate_of_its_own(
        engine: LlamaCppEngine) -> None:
    """llama.cpp maps the GGUF with MAP_POPULATE inside its model load: the report gives that
    load's time, and the summary `generate --local` prints names it instead of a populate of
    0 ms (the numpy engine's populate keeps its own line)."""
    from edge_agent.runtime.memlock import lock_summary

    report = engine.lock_report()
    assert report is not None and report["populate_s"] is None
    assert report["model_load_s"] > 0
    line = lock_summary(report)
    assert f"llama.cpp load {report['model_load_s'] * 1e3:.1f} ms" in line
    assert "populate" not in line
    assert "populate 12.0 ms" in lock_summary(dict(report, populate_s=0.012))


def test_ctrl_c_inside_llama_cpps_log_callback_is_raised_after_the_call(
        tmp_path: Path) -> None:
    import os
    import signal

    from edge_agent.runtime.llama_vocab import llama_lib, recent_errors, sigint_after_call

    lib = llama_lib()
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))  # llama.cpp logs its errors through our callback
    params = lib.llama_model_default_params()
    params.vocab_only = True
    ran_on = []
    # Python's own handler, as under a terminal (a test run started in the background of a
    # shell without job control inherits SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with sigint_after_call():
                os.kill(os.getpid(), signal.SIGINT)  # pending: delivered at the next bytecode
                model = lib.llama_model_load_from_file(str(bad).encode(), params)
                ran_on.append(bool(model))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert ran_on == [False]  # the call ran to its end; the interrupt came after it
    assert recent_errors()  # and the callback did run Python in between


def test_ctrl_c_during_the_model_load_stops_generate_with_130(gemma_path: Path) -> None:
    import signal
    import time

    # the signal lands while llama.cpp loads Gemma 3 (or just before or after): exit 130
    # every time, never a completion printed after an ignored interrupt. Timed from the line
    # generate prints just before it loads (a fixed delay from the spawn could land in the
    # interpreter's own start on a loaded machine)
    for delay in (0.0, 0.1, 0.25):
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge_agent", "generate", "--model", str(gemma_path),
             "--engine", "llamacpp", "--max-tokens", "200", "--mlock", "off", "Once upon a time"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=interrupt.env(),
            preexec_fn=interrupt.foreground)
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "loading the model in this process" in first, first
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = interrupt.finish(proc, 120)
        # 130, or ended by the SIGINT itself (CPython's exit after an interrupt at some points):
        # a shell's $? is 130 either way; never 0 with a completion after an ignored interrupt
        assert proc.returncode in (130, -signal.SIGINT), (delay, out, err)
        assert out == "" and "edge-agent: interrupted" in err, (delay, out, err)
        assert "Exception ignored" not in err, err


def test_repacked_weights_are_locked_too(tmp_path: Path) -> None:
    """A Q4_0 file: llama.cpp repacks its matrices into anonymous memory for its CPU kernels;
    a lock of the file alone would leave those copies pageable. Both are locked. The engine
    finds the copies as the anonymous regions the load creates, so the load runs in a fresh
    process, as in a runner (one model per process): in a process that loaded and freed other
    engines, the allocator may put them in memory it already holds."""
    import ctypes

    from edge_agent.runtime.llama_vocab import llama_lib

    lib = llama_lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype = 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    q4_0 = tmp_path / "smollm2-q4_0.gguf"
    assert lib.llama_model_quantize(str(default_model_path()).encode(), str(q4_0).encode(),
                                    ctypes.byref(params)) == 0
    probe = (
        "import json, sys\n"
        "from edge_agent.runtime.llamacpp import LlamaCppEngine\n"
        "with LlamaCppEngine.load(sys.argv[1], max_batch=1, context=64,"
        " mlock='best-effort') as e:\n"
        "    print(json.dumps(e.lock_report()))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(q4_0)], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    report = json.loads(out.splitlines()[-1])
    assert report is not None
    if not report["locked"]:
        pytest.skip(f"mlock refused here: {report['error']}")
    assert report["anonymous_bytes"] > 16 << 20  # the repacked copies
    assert report["locked_bytes"] >= report["weight_bytes"] + report["anonymous_bytes"] // 2
    assert report["vmlck_bytes"] >= report["locked_bytes"]


def _batch(engine: LlamaCppEngine, prompts: list[str], n: int) -> dict[str, list[int]]:
    tok = engine.tokenizer
    first, errors = engine.add_many([NewSeq(str(i), tok.encode(p), GREEDY)
                                     for i, p in enumerate(prompts)])
    assert not errors
    out = {k: [v] for k, v in first.items()}
    try:
        for _ in range(n - 1):
            for k, v in engine.step(list(out)).items():
                out[k].append(v)
    finally:
        for k in out:
            engine.release(k)
    return out


def _until_eog(engine: LlamaCppEngine, ids: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in engine.stop_ids:
            return ids[:i]
    return ids


def test_batch_invariance_is_measured_truthfully(engine: LlamaCppEngine) -> None:
    """The probe's verdict agrees with what a batch of 8 does to 8 prompts."""
    verdict = engine.batch_invariance(engine.tokenizer.encode(PROMPTS[0]))
    alone = [list(engine.generate(engine.tokenizer.encode(p), GREEDY)) for p in PROMPTS]
    batch = _batch(engine, PROMPTS, GREEDY.max_tokens)
    same = sum(_until_eog(engine, batch[str(i)]) == a for i, a in enumerate(alone))
    if verdict:
        assert same == len(PROMPTS)
    else:  # the probe saw different logits; at least the probe prompt's batch run is real
        assert same <= len(PROMPTS)


def test_smollm2_is_batch_invariant_and_resumes_exactly(model: Path,
                                                       engine: LlamaCppEngine) -> None:
    if model != default_model_path():
        pytest.skip("measured per model: the default SmolLM2 Q4_1 is invariant here")
    assert engine.batch_invariance(engine.tokenizer.encode(PROMPTS[0]))
    assert engine.batch_invariance(())  # the runner's probe prompt
    for prompt in PROMPTS[:4]:
        whole = list(engine.generate(engine.tokenizer.encode(prompt), GREEDY))
        assert _resumed_at_half(engine, prompt, whole) == whole, prompt


def _resumed_at_half(engine: LlamaCppEngine, prompt: str, whole: list[int]) -> list[int]:
    """`whole` (a greedy run of `prompt`) cut at its half and resumed by prefill."""
    cut = len(whole) // 2
    rest = [engine.add("r", engine.tokenizer.encode(prompt), GREEDY, generated=whole[:cut])]
    try:
        while cut + len(rest) < len(whole):
            rest.append(engine.step(["r"])["r"])
    finally:
        engine.release("r")
    return whole[:cut] + rest[: len(whole) - cut]


def _run_with_logprobs(engine: LlamaCppEngine, ids: list[int], params: SamplingParams,
                       n: int) -> list[tuple[int, float]]:
    """(token, its log-probability) of `n` uninterrupted steps of one sequence."""
    out = [(engine.add("u", ids, params), engine.last_logprobs["u"].logprob)]
    try:
        while len(out) < n:
            out.append((engine.step(["u"])["u"], engine.last_logprobs["u"].logprob))
    finally:
        engine.release("u")
    return out


def test_smollm2_resumes_bit_exactly_at_every_cut_point(model: Path,
                                                         engine: LlamaCppEngine) -> None:
    """A resume (prompt prefilled, generated tokens replayed) continues with the very
    log-probabilities of the uninterrupted run, wherever the cut falls, with several resumes
    sharing the prefill and the replay: the KV cells are the same bits, not just close ones.
    (Measured before the replay: prefilling the generated tokens instead gave other tokens
    for cuts after 64 of "Once upon a time" here.)"""
    if model != default_model_path():
        pytest.skip("measured per model: the default SmolLM2 Q4_1 is invariant here")
    params = SamplingParams(max_tokens=96, temperature=0.0, logprobs=0)
    ids = engine.tokenizer.encode("Once upon a time")
    whole = _run_with_logprobs(engine, ids, params, 96)
    tokens = [t for t, _ in whole]
    assert not set(tokens) & set(engine.stop_ids), "pick a prompt that runs 96 tokens"
    cuts = list(range(1, len(whole) - 2))
    group = engine.max_batch - 1
    for g in range(0, len(cuts), group):
        batch = cuts[g:g + group]
        firsts, errors = engine.add_many(
            [NewSeq(f"c{c}", ids, params, tokens[:c]) for c in batch])
        assert not errors, errors
        got = {c: [(firsts[f"c{c}"], engine.last_logprobs[f"c{c}"].logprob)] for c in batch}
        try:
            for _ in range(2):
                step = engine.step([f"c{c}" for c in batch])
                for c in batch:
                    got[c].append((step[f"c{c}"], engine.last_logprobs[f"c{c}"].logprob))
        finally:
            for c in batch:
                engine.release(f"c{c}")
        for c in batch:
            assert got[c] == whole[c:c + 3], f"resumed after {c} tokens"


def test_smollm2_a_long_prompt_next_to_a_short_one_keeps_its_bits(model: Path,
                                                                  engine: LlamaCppEngine) -> None:
    """A prompt of 64 rows or more prefilled next to a short one, in the neighbouring slot,
    gives the log-probabilities it gives alone. (llama.cpp computes a call in parts with as
    many rows of each sequence: shared, the long prompt's head went row by row and its rest
    through the tiled attention kernel, and its first tokens' log-probabilities changed.)"""
    if model != default_model_path():
        pytest.skip("measured per model: the default SmolLM2 Q4_1 is invariant here")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    long_ids = engine.tokenizer.encode(" ".join(PROMPTS * 4))
    assert 64 <= len(long_ids) < 200
    engine.clear_cache()
    alone = _run_with_logprobs(engine, long_ids, params, 8)
    engine.clear_cache()
    short_ids = engine.tokenizer.encode("Tell me about the moon and the stars tonight.")
    firsts, errors = engine.add_many([NewSeq("l", long_ids, params),
                                      NewSeq("s", short_ids, params)])
    assert not errors, errors
    assert abs(engine._seqs["l"].slot - engine._seqs["s"].slot) == 1  # one compute for both
    got = [(firsts["l"], engine.last_logprobs["l"].logprob)]
    try:
        while len(got) < 8:
            got.append((engine.step(["s", "l"])["l"], engine.last_logprobs["l"].logprob))
    finally:
        engine.release("l")
        engine.release("s")
    assert got == alone


def test_busy_slots_stay_together_and_steps_list_them_in_order(
        engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp computes a step once per run of consecutive slots (in the order the rows
    list them): a new sequence fills the hole a finished one left, and a step's rows go in
    slot order whatever order the caller names the sequences in."""
    engine.clear_cache()
    ids = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    names = ["a", "b", "c", "d"]
    _, errors = engine.add_many([NewSeq(n, ids, params) for n in names])
    assert not errors, errors
    try:
        slots = sorted(engine._seqs[n].slot for n in names)
        assert slots == list(range(slots[0], slots[0] + 4))
        hole = engine._seqs["b"].slot
        engine.release("b")
        engine.add("e", ids, params)
        assert engine._seqs["e"].slot == hole
        seen: list[list[int]] = []
        decode = engine._decode
        monkeypatch.setattr(engine, "_decode",
                            lambda rows: (seen.append([r[2] for r in rows]), decode(rows))[1])
        tokens = engine.step(["d", "a", "e", "c"])
        assert sorted(tokens) == ["a", "c", "d", "e"]
        assert seen == [sorted(seen[0])] and len(seen[0]) == 4
    finally:
        for n in ["a", "c", "d", "e"]:
            engine.release(n)
        engine.clear_cache()


def test_the_probe_verdict_is_remembered_by_what_it_depends_on(
        engine: LlamaCppEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up probe runs once per model file, build, CPU and shape: its verdict comes
    from the cache file next time, a changed input probes again, a damaged file is
    rewritten."""
    cache = tmp_path / "state" / "batch-invariance.json"
    ids = engine.tokenizer.encode(PROMPTS[0])
    probes: list[int] = []
    probe = engine._probe_invariance
    monkeypatch.setattr(engine, "_probe_invariance",
                        lambda i: (probes.append(1), probe(i))[1])
    verdict = engine.batch_invariance(ids, cache=cache)
    assert probes == [1] and cache.exists()
    engine.exact_reuse = not verdict
    assert engine.batch_invariance(ids, cache=cache) is verdict and probes == [1]
    assert engine.exact_reuse is verdict  # the prompt cache's mode follows the verdict
    stored = json.loads(cache.read_text())["verdicts"]
    stored = {k: not v for k, v in stored.items()}  # a stored verdict is taken as it is
    cache.write_text(json.dumps({"verdicts": stored}))
    assert engine.batch_invariance(ids, cache=cache) is (not verdict) and probes == [1]
    engine.batch_invariance(ids[:-1], cache=cache)  # another probe prompt: probed
    assert probes == [1, 1]
    monkeypatch.setattr(engine, "threads", engine.threads + 1)
    assert engine.batch_invariance(ids, cache=cache) is verdict and len(probes) == 3
    cache.write_text("{damaged")
    assert engine.batch_invariance(ids, cache=cache) is verdict and len(probes) == 4
    assert json.loads(cache.read_text())["verdicts"] == {engine._probe_key(ids): verdict}


def test_gemma3_kernels_depend_on_the_batch_here(model: Path, engine: LlamaCppEngine) -> None:
    """Gemma 3 Q4_K_M on this CPU: logits of one sequence change with the number of rows in
    the step (measured: 1 | 2-3 | 4+ rows with repacked weights). The engine reports it, so
    /health can say so; if a llama.cpp upgrade makes it invariant this test says so too."""
    if model == default_model_path():
        pytest.skip("Gemma 3 only")
    assert engine.batch_invariance(engine.tokenizer.encode(PROMPTS[0])) is False
    assert engine.batch_invariance(()) is False  # the runner's probe prompt sees it too
    # (a lone BOS does not: one token's logits after it are the same for 1 to 8 rows here)


def test_decode_alone_makes_gemma3_exact(model: Path) -> None:
    """`decode = "alone"` (one llama_decode per sequence): Gemma 3, whose tokens depend on its
    batch when decoded batched (above), gives every prompt the same tokens alone and in a batch
    of 8, the probe measures it invariant, and a resume by prefill continues exactly."""
    if model == default_model_path():
        pytest.skip("Gemma 3 only (the model whose batched decoding is not exact)")
    e = LlamaCppEngine.load(model, max_batch=8, context=256, mlock="off", threads=2,
                            decode="alone")
    try:
        assert e.describe()["decode"] == "alone"
        assert e.batch_invariance(()) is True
        tok = e.tokenizer
        alone = [list(e.generate(tok.encode(p), GREEDY)) for p in PROMPTS]
        batch = _batch(e, PROMPTS, GREEDY.max_tokens)
        assert [_until_eog(e, batch[str(i)]) for i in range(len(PROMPTS))] == alone
        for prompt, whole in zip(PROMPTS[:4], alone[:4], strict=True):
            assert _resumed_at_half(e, prompt, whole) == whole, prompt
    finally:
        e.close()


def test_a_failed_call_of_an_alone_step_advances_no_sequence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An alone step is one llama_decode per sequence; when one of them fails, the cells the
    earlier ones wrote are removed: no sequence advances, and the next step gives the tokens
    an unbroken run gives."""
    e = LlamaCppEngine.load(default_model_path(), max_batch=4, context=128, mlock="off",
                            threads=2, decode="alone")
    try:
        tok = e.tokenizer
        ids = {str(i): tok.encode(p) for i, p in enumerate(PROMPTS[:3])}
        want = {k: list(e.generate(v, SamplingParams(max_tokens=2, temperature=0.0)))
                for k, v in ids.items()}
        first, errors = e.add_many([NewSeq(k, v, GREEDY) for k, v in ids.items()])
        assert not errors and first == {k: w[0] for k, w in want.items()}
        lengths = {k: e.length(k) for k in ids}
        real, calls = e._decode, []

        def second_call_fails(rows: list[tuple[int, int, int, bool]]) -> None:
            calls.append(rows)
            if len(calls) == 2:
                raise LlamaCppError("llama_decode returned 1 (injected)")
            real(rows)

        monkeypatch.setattr(e, "_decode", second_call_fails)
        with pytest.raises(LlamaCppError, match="injected"):
            e.step(list(ids))
        assert len(calls) == 2 and all(len(rows) == 1 for rows in calls)
        monkeypatch.undo()
        for k in ids:
            assert e.length(k) == lengths[k]
            assert e._lib.llama_memory_seq_pos_max(e._mem, e._seqs[k].slot) == lengths[k] - 1
        assert e.step(list(ids)) == {k: w[1] for k, w in want.items()}
    finally:
        e.close()


def test_gemma3_has_no_chat_template_and_says_which_key(model: Path,
                                                         engine: LlamaCppEngine) -> None:
    tok = engine.tokenizer
    if model == default_model_path():
        ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
        start = tok.tokenize("<|im_start|>", add_bos=False, parse_special=True)
        assert len(start) == 1 and ids[0] == start[0]  # a control token, not its text
        assert tok.decode(ids[1:]).startswith("system\n")
        assert tok.turn_end_ids() == [*tok.tokenize("<|im_end|>\n", add_bos=False,
                                                    parse_special=True)]
        return
    with pytest.raises(EdgeAgentError, match="tokenizer.chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_sentencepiece_vocabulary_round_trips_text(model: Path, engine: LlamaCppEngine) -> None:
    tok = engine.tokenizer
    text = "héllo wörld — ünïcode ✓ 日本語 🙂 done"
    ids = tok.encode(text)
    body = [i for i in ids if i not in tok.special_ids]
    assert tok.decode(body).strip() == text  # SPM adds a leading space on some vocabularies


def test_errors_name_the_input(engine: LlamaCppEngine, tmp_path: Path) -> None:
    with pytest.raises(EdgeAgentError, match="outside the vocabulary"):
        engine.add("bad", [engine.n_vocab + 5], GREEDY)
    with pytest.raises(EdgeAgentError, match="context is 256"):
        engine.add("long", [1] * 300, GREEDY)
    with pytest.raises(EdgeAgentError, match="no active sequence 'nope'"):
        engine.step(["nope"])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x7fELF" + bytes(100))
    with pytest.raises(ModelFileError, match="not a GGUF file") as exc:
        LlamaCppEngine.load(junk, mlock="off")
    assert str(junk) in str(exc.value) and "Hint:" in str(exc.value)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path().read_bytes()[: 3 << 20])
    with pytest.raises(ModelFileError, match="truncated") as exc:
        LlamaCppEngine.load(cut, mlock="off")
    assert str(cut) in str(exc.value) and "Hint:" in str(exc.value)


@pytest.mark.parametrize("parse_special", [True, False])
def test_numpy_tokenizer_tokenizes_as_llama_cpp(tokenizer: object, parse_special: bool) -> None:
    """Both engines' tokenizers answer /tokenize alike: control-token text parsed only when
    asked, BOS only when asked (llama.cpp's own vocabulary is the oracle)."""
    from edge_agent.runtime.llama_vocab import LlamaVocab

    vocab = LlamaVocab.load(default_model_path())
    try:
        for text in ["<|im_start|>user\nHi<|im_end|>\n", "plain text, <|im_end|> inside",
                     "héllo 🙂 <|endoftext|>"]:
            for add_bos in (False, True):
                ours = tokenizer.tokenize(text, add_bos=add_bos,  # type: ignore[attr-defined]  # the llama.cpp engine's tokenizer
                                          parse_special=parse_special)
                assert ours == vocab.tokenize(text, add_bos=add_bos,
                                              parse_special=parse_special), text
    finally:
        vocab.close()


def test_tokenize_follows_the_configured_engine_as_the_daemon_would(
        gemma_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`tokenize` without --engine uses runtime.engine: configured numpy, Gemma 3's SentencePiece
    vocabulary is refused with the way out named; --engine overrides the configuration."""
    from edge_agent.cli import main

    gemma = str(gemma_path)
    monkeypatch.setenv("EDGE_AGENT_RUNTIME__ENGINE", "numpy")
    assert main(["tokenize", "--model", gemma, "Hi there"]) == 1
    err = capsys.readouterr().err
    assert ("'tokenizer.ggml.model' is 'llama', which the numpy engine's tokenizer does not "
            "read") in err
    assert "--engine llamacpp, or runtime.engine = \"llamacpp\"" in err
    assert main(["tokenize", "--model", gemma, "--engine", "llamacpp", "--json",
                 "Hi there"]) == 0
    with_llamacpp = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("EDGE_AGENT_RUNTIME__ENGINE", "llamacpp")
    assert main(["tokenize", "--model", gemma, "--json", "Hi there"]) == 0
    assert json.loads(capsys.readouterr().out) == with_llamacpp


def test_detokenize_shows_control_tokens_as_llama_cpp_does(model: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """`detokenize` (POST /detokenize, `tokenize --decode`) renders control tokens as their text,
    as llama.cpp's detokenize with special=True; `decode` (a completion's text) does not."""
    from edge_agent.cli import main
    from edge_agent.runtime.llama_vocab import LlamaVocab

    vocab = LlamaVocab.load(model)
    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    try:
        ids = vocab.tokenize("<start_of_turn>user\nHi<end_of_turn>\n<|im_start|>a<|im_end|>",
                             add_bos=True, parse_special=True)
        special = [i for i in ids if i in vocab.special_ids]
        assert len(special) >= 2  # BOS and the model's own turn markers
        want = llm.detokenize(ids, special=True).decode("utf-8", "replace")
        assert vocab.detokenize(ids) == want
        assert vocab.decode(ids) == llm.detokenize(ids, special=False).decode("utf-8", "replace")
        assert vocab.decode(ids) != want
        # the CLI, on any vocabulary type (Gemma 3's is SPM), both ways
        assert main(["tokenize", "--model", str(model), "--engine", "llamacpp", "--decode",
                     " ".join(map(str, ids))]) == 0
        assert capsys.readouterr().out == want
        text = "Hello  2024, héllo"
        assert main(["tokenize", "--model", str(model), "--json", text]) == 0
        assert json.loads(capsys.readouterr().out) == llm.tokenize(
            text.encode(), add_bos=vocab.add_bos, special=False)
    finally:
        llm.close()
        vocab.close()


def test_the_engine_loads_the_bindings_without_the_high_level_api() -> None:
    """The control plane and the runner import only llama-cpp-python's ctypes bindings (its
    package `__init__` would import llama.py, jinja2, diskcache and numpy for an API they never
    use); the high-level API still works in a process that asks for it afterwards."""
    probe = (
        "import sys\n"
        "from edge_agent.runtime.llama_vocab import llama_lib\n"
        "lib = llama_lib()\n"
        "print(sorted(m for m in ('llama_cpp.llama', 'jinja2', 'diskcache', 'numpy')"
        " if m in sys.modules))\n"
        "import llama_cpp\n"
        "from llama_cpp import Llama\n"
        "print(llama_cpp.__version__, Llama.__module__, llama_cpp.llama_cpp is lib)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out[0] == "[]", out
    assert out[1] == f"{llama_cpp.__version__} llama_cpp.llama True", out
