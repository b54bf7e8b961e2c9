"""Bounded reads of the small files a path names: the configuration, host board profiles and
MCU board profiles. Only regular files of at most 1 MiB are read; a directory, a FIFO, a device
or a larger file is refused with an error naming the path, what it is, and a Hint. A FIFO is
never opened for reading (nothing blocks) and /dev/zero is never read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_agent.config import load_config
from edge_agent.errors import ConfigError
from edge_agent.filekind import FileKindError, read_regular
from edge_agent.host_profiles import load_host_profile
from firmware_tools.profiles import ProfileError, load_profile

pytestmark = pytest.mark.timeout(30)  # a FIFO that is waited on would hang

HOST_PROFILE = 'kind = "host"\ndescription = "test board"\n'
MCU_PROFILE = Path(__file__).resolve().parent.parent / "board_profiles" / "stm32f405.toml"


def make(kind: str, tmp_path: Path, text: str) -> Path:
    """A path that is `kind`: a directory, a FIFO, a character device, or a regular file over
    1 MiB that is valid TOML (so only its size can refuse it)."""
    if kind == "directory":
        path = tmp_path / "x.toml"
        path.mkdir()
    elif kind == "fifo":
        path = tmp_path / "x.toml"
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path = tmp_path / "x.toml"
        path.write_text(text + "# " + "x" * (1 << 20) + "\n")
    return path


WHAT = {"directory": "is a directory", "fifo": "is a FIFO (named pipe)",
        "device": "is a character device", "large": "more than the"}
WHAT_FW = {"directory": "it is a directory", "fifo": "it is a FIFO (named pipe)",
           "device": "it is a character device", "large": "more than the 1048576-byte limit"}
KINDS = list(WHAT)


@pytest.mark.parametrize("kind", KINDS)
def test_read_regular_refuses_what_is_not_a_small_regular_file(tmp_path: Path,
                                                               kind: str) -> None:
    path = make(kind, tmp_path, "")
    with pytest.raises(FileKindError, match=re.escape(WHAT[kind])):
        read_regular(path, 1 << 20)
    ok = tmp_path / "ok.toml"
    ok.write_bytes(b"a = 1\n")
    assert read_regular(ok, 6) == b"a = 1\n"
    with pytest.raises(FileKindError, match="is 6 bytes, more than the limit of 5 bytes"):
        read_regular(ok, 5)
    with pytest.raises(FileKindError, match="no such file"):
        read_regular(tmp_path / "missing.toml", 5)


def check(err: Exception, path: Path, fragment: str) -> None:
    message = str(err)
    assert str(path) in message and fragment in message and "Hint:" in message, message


@pytest.mark.parametrize("kind", KINDS)
def test_config_file_must_be_a_small_regular_file(tmp_path: Path, kind: str) -> None:
    path = make(kind, tmp_path, "[server]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={}, check_paths=False)
    check(info.value, path, WHAT[kind])
    assert info.value.exit_code == 78


def test_a_one_mib_config_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    body = '[server]\ndrain_timeout_s = 3\n'
    path.write_text(body + "#" * ((1 << 20) - len(body) - 1) + "\n")
    assert path.stat().st_size == 1 << 20
    assert load_config(path, env={}, check_paths=False).server.drain_timeout_s == 3


@pytest.mark.parametrize("kind", KINDS)
def test_host_board_profile_must_be_a_small_regular_file(tmp_path: Path, kind: str) -> None:
    path = make(kind, tmp_path, HOST_PROFILE)
    with pytest.raises(ConfigError) as info:
        load_host_profile(str(path), env={}, dirs=[tmp_path])
    check(info.value, path, WHAT[kind])


def test_host_board_profile_by_name_in_a_directory_that_holds_a_fifo(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "myboard.toml").write_text(HOST_PROFILE)
    assert load_host_profile("myboard", env={}, dirs=[tmp_path]).description == "test board"


@pytest.mark.parametrize("kind", KINDS)
def test_mcu_board_profile_must_be_a_small_regular_file(tmp_path: Path, kind: str) -> None:
    path = make(kind, tmp_path, MCU_PROFILE.read_text())
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    check(info.value, path, WHAT_FW[kind])
    assert info.value.exit_code == 78


def test_binary_files_are_refused_as_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "b.toml"
    path.write_bytes(b"\x7fELF\x01\x01\x01\x00\xff\xfe")
    loaders: list[tuple[Callable[[], object], type[Exception]]] = [
        (lambda: load_config(path, env={}, check_paths=False), ConfigError),
        (lambda: load_host_profile(str(path), env={}, dirs=[tmp_path]), ConfigError),
        (lambda: load_profile(path), ProfileError),
    ]
    for load, error in loaders:
        with pytest.raises(error) as info:
            load()
        check(info.value, path, "not UTF-8 text")
