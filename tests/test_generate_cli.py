"""`edge-agent generate`: completion alone on stdout, diagnostics on stderr, exit codes."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from edge_agent.cli import main

STORY = "Once upon a time, in a small village by the sea,"


def _run(state, *argv, capsys, local=True, engine="numpy"):
    """In process by default on the numpy engine, whose oracle is the transformers reference."""
    code = main(["--state-dir", str(state), "generate", "--mlock", "off",
                 *(["--local", "--engine", engine] if local else []), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_stdout_is_exactly_the_completion(prepared_state_dir, tokenizer, reference_logits):
    import os

    expected = tokenizer.decode(reference_logits["story__generated_ids"][:8].tolist())
    # no --engine: --local runs the configured runtime.engine (numpy here, from the
    # environment), as the daemon would; its f32 weights are the size that tells
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "edge_agent", "--state-dir", str(prepared_state_dir),
         "generate", "--local", "--max-tokens", "8", STORY],
        capture_output=True, text=True, timeout=120,
        env={**env, "EDGE_AGENT_RUNTIME__ENGINE": "numpy"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected
    assert "weights 513.1 MiB: " in proc.stderr and "VmLck" in proc.stderr


def test_chat_prompt_uses_the_template_and_stops_at_eos(prepared_state_dir, capsys):
    code, out, err = _run(prepared_state_dir, "--chat", "-v", "What is the capital of France?",
                          capsys=capsys)
    assert code == 0
    assert out == "The capital of France is Paris."
    assert "not locked (mlock policy off)" in err
    # in process, said at any verbosity
    assert "edge-agent: loading the model in this process (--local), not using a daemon" in err
    assert "prompt 37 tokens; 7 tokens in" in err  # the reference chat prompt is 37 tokens


def test_stop_text_and_prompt_from_stdin(prepared_state_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?"))
    code, out, _ = _run(prepared_state_dir, "--chat", "--stop", "Paris", "-", capsys=capsys)
    assert (code, out) == (0, "The capital of France is ")


def test_stop_text_takes_llama_cpps_escapes(tmp_path, capsys):
    from edge_agent.commands.generate import process_escapes

    assert process_escapes(r"\n\n") == "\n\n"
    assert process_escapes(r"a\tb\r\x41\'\"") == "a\tb\rA'\""
    assert process_escapes(r"\\n") == "\\n"  # an escaped backslash, then a plain n
    # unknown escapes stay as typed; a doubled backslash is one
    assert process_escapes(r"\q \xZZ end\\ \\") == "\\q \\xZZ end\\ \\"
    pytest.importorskip("llama_cpp", reason="the default engine's greedy text")
    # the documented example: --stop "\n\n" (as a shell passes it) stops at the blank line
    prompt = ("--max-tokens", "16", "The capital of France is")
    code, whole, _ = _run(tmp_path, *prompt, capsys=capsys, engine="llamacpp")
    assert code == 0 and "\n\n" in whole, whole
    code, out, _ = _run(tmp_path, "--stop", r"\n\n", *prompt, capsys=capsys, engine="llamacpp")
    assert code == 0 and out == whole[:whole.index("\n\n")], (out, whole)


def test_seeded_sampling_is_reproducible(prepared_state_dir, capsys):
    args = ("--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--max-tokens", "12")
    a = _run(prepared_state_dir, *args, "--seed", "5", STORY, capsys=capsys)
    b = _run(prepared_state_dir, *args, "--seed", "5", STORY, capsys=capsys)
    c = _run(prepared_state_dir, *args, "--seed", "6", STORY, capsys=capsys)
    assert a[0] == b[0] == c[0] == 0
    assert a[1] == b[1] and a[1] != c[1]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--temperature", "-1", "x"], "temperature -1.0 must be a finite number >= 0"),
        (["--top-p", "2", "x"], "top_p 2.0 must be in (0, 1]"),
        (["--top-k", "-3", "x"], "top_k -3 must be an integer >= 0"),
        (["--max-tokens", "0", "x"], "max_tokens 0 must be an integer >= 1"),
        (["--threads", "-1", "x"], "--threads -1 must be >= 0"),
        ([""], "the prompt is empty"),
    ],
)
def test_bad_usage_exits_2_with_a_hint(tmp_path, capsys, argv, fragment):
    code, out, err = _run(tmp_path, *argv, capsys=capsys)
    assert code == 2 and out == ""
    assert err.startswith("edge-agent: error: ") and fragment in err and "Hint:" in err


def test_bad_model_file_exits_1_naming_it(tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x7fELF" + bytes(100))
    code, out, err = _run(tmp_path, "--model", str(junk), "hello", capsys=capsys)
    assert code == 1 and out == ""
    assert f"{junk}: not a GGUF file (magic b'\\x7fELF'" in err and "Hint:" in err
    missing = tmp_path / "nope.gguf"
    code, out, err = _run(tmp_path, "--model", str(missing), "hello", capsys=capsys)
    assert code == 1 and out == "" and str(missing) in err and "Hint:" in err


def test_help_lists_the_sampling_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--chat",
                 "--mlock", "--dtype", "--local", "PROMPT"):
        assert flag in out


# ----- where it runs: through the daemon, or in this process only when asked -------------------


@pytest.fixture
def short_state():
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="ea-gen-", dir="/tmp"))  # AF_UNIX paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _refuses_without_loading(monkeypatch, capsys, argv):
    from edge_agent.runtime import engine

    def no_load(*a, **k):
        raise AssertionError("generate loaded the model in process without --local")

    monkeypatch.setattr(engine.Engine, "load", no_load)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1 and out == "", err
    assert "loading the model in this process" not in err
    return err


def test_no_daemon_refuses_and_names_local(short_state, monkeypatch, capsys):
    err = _refuses_without_loading(monkeypatch, capsys,
                                   ["--state-dir", str(short_state), "generate", "hello"])
    sock = short_state / "edge-agent.sock"
    assert f"edge-agent: error: generate: no daemon: {sock} does not exist. Hint: " in err
    assert "`make run`" in err and "--local to load the model in this process" in err
    # --socket after the command names another missing socket: the same refusal, naming it
    err = _refuses_without_loading(monkeypatch, capsys,
                                   ["generate", "hello", "--socket", str(short_state / "x.sock")])
    assert f"no daemon: {short_state / 'x.sock'} does not exist" in err


def test_a_socket_that_does_not_answer_refuses_and_names_local(short_state, monkeypatch,
                                                                capsys):
    import socket

    sock = short_state / "edge-agent.sock"
    with socket.socket(socket.AF_UNIX) as s:  # bound, never listening: a dead daemon's socket
        s.bind(str(sock))
        err = _refuses_without_loading(monkeypatch, capsys,
                                       ["generate", "--state-dir", str(short_state), "hello"])
    assert f"generate: the daemon socket {sock} exists but does not answer (" in err
    assert "Connection refused" in err and err.count("Hint:") == 1
    assert "`edge-agent status`" in err and "--local loads the model in this process" in err


def test_help_states_where_generate_runs(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "When no daemon answers, generate stops with an error instead of loading the " \
        "model itself; --local (or --model PATH) loads the model in this process" in out
