"""Layered configuration: each layer, the precedence between them, and every error's message."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

import edge_agent.config as config_mod
from edge_agent import cli
from edge_agent.config import BUILTIN_MODEL, load_config
from edge_agent.config_schema import KEYS, SECTIONS
from edge_agent.errors import EXIT_CONFIG, ConfigError
from edge_agent.host_profiles import list_host_profiles, load_host_profile
from edge_agent.sizes import format_size, parse_size

REPO_PROFILES = Path(__file__).resolve().parent.parent / "board_profiles"


@pytest.fixture(autouse=True)
def _no_system_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Hermetic: the machine's /etc/edge-agent/config.toml (if any) must not leak in.
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "config.toml")


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "testboard.toml").write_text(
        'kind = "host"\ndescription = "test board"\n[hardware]\ncpus = 2\n'
        "[agent]\nscheduler.queue_max = 20\nruntime.threads = 2\n"
    )
    (d / "mcuchip.toml").write_text('kind = "mcu"\ndescription = "an MCU"\n')
    return d


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def load(**kw):
    kw.setdefault("env", {})
    kw.setdefault("check_paths", False)
    return load_config(**kw)


# ----- built-in defaults -------------------------------------------------------------------------


def test_builtin_defaults() -> None:
    c = load(env={"EDGE_AGENT_STATE_DIR": "/tmp/st"})
    assert c.server.socket == Path("/tmp/st/edge-agent.sock")  # the socket goes with the state
    assert c.server.state_dir == Path("/tmp/st")
    assert c.server.socket_mode == 0o660 and c.server.max_body_bytes == 1 << 20
    assert c.server.tcp == "" and c.server.drain_timeout_s == 30.0
    assert c.scheduler.queue_max == 64 and c.scheduler.max_batch_size == 8
    assert c.runtime.mlock == "best-effort" and c.runtime.threads is None
    assert c.runtime.memory_budget_bytes is None
    assert c.default_model == BUILTIN_MODEL and list(c.models) == [BUILTIN_MODEL]
    m = c.model()
    assert m.path is None and m.context == 2048 and m.max_batch == 8 and m.priority == 5
    assert m.resolve_path().name.endswith(".gguf")
    assert c.sources == ("built-in defaults",)


def test_systemd_directories_set_socket_and_state() -> None:
    c = load(env={"RUNTIME_DIRECTORY": "/run/x", "STATE_DIRECTORY": "/var/lib/x:/other"})
    assert c.server.socket == Path("/run/x/edge-agent.sock")
    assert c.server.state_dir == Path("/var/lib/x")


def test_scheduler_settings_feed_the_scheduler() -> None:
    from edge_agent.scheduler import Scheduler, SchedulerConfig

    c = load(env={"EDGE_AGENT_SCHEDULER__QUEUE_MAX": "7"})
    assert isinstance(c.scheduler, SchedulerConfig)
    assert Scheduler(c.scheduler).config.queue_max == 7
    # every scheduler knob is a config key, and the defaults documented for the keys are the
    # scheduler's own
    keys = SECTIONS["scheduler"]
    assert set(keys) == set(asdict(SchedulerConfig()))
    for name, default in asdict(SchedulerConfig()).items():
        assert keys[name].parse(keys[name].default) == default, name
    assert load().scheduler == SchedulerConfig()


# ----- file layer ------------------------------------------------------------------------------


def test_file_layer(tmp_path: Path) -> None:
    gguf = write(tmp_path / "tiny.gguf", "x")
    cfg = write(tmp_path / "config.toml", """
default_model = "tiny"
[server]
socket = "/tmp/ea.sock"
socket_mode = 0o600
max_body_bytes = "64K"
tcp = "127.0.0.1:8080"
[runtime]
memory_budget_bytes = "2G"
threads = 2
mlock = "required"
[models.tiny]
path = "tiny.gguf"
context = 512
ttl_s = "never"
preload = true
""")
    c = load(path=cfg, check_paths=True)
    assert c.server.socket == Path("/tmp/ea.sock") and c.server.socket_mode == 0o600
    assert c.server.max_body_bytes == 65536 and c.server.tcp == "127.0.0.1:8080"
    assert c.runtime.memory_budget_bytes == 2 << 30 and c.runtime.threads == 2
    tiny = c.models["tiny"]
    assert tiny.path == gguf.resolve()  # relative to the file's directory
    assert tiny.context == 512 and tiny.ttl_s is None and tiny.preload is True
    assert tiny.max_batch == c.scheduler.max_batch_size
    assert set(c.models) == {"tiny", BUILTIN_MODEL}
    assert c.sources == ("built-in defaults", str(cfg))


def test_default_file_is_optional_and_read_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = write(tmp_path / "default.toml", "[scheduler]\nqueue_max = 3\n")
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", default)
    assert load().scheduler.queue_max == 3


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: does not exist\. Hint: check the --config"):
        load(path=tmp_path / "nope.toml")


def test_bad_toml_names_file_and_line(tmp_path: Path) -> None:
    cfg = write(tmp_path / "bad.toml", "[server]\nsocket = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML .*line 2"):
        load(path=cfg)


def test_unknown_key_in_file_lists_valid_keys(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", "[scheduler]\nqueue_mx = 3\n")
    with pytest.raises(ConfigError) as err:
        load(path=cfg)
    msg = str(err.value)
    assert "'queue_mx' in [scheduler]" in msg and str(cfg) in msg
    assert "valid: queue_max, max_batch_size" in msg and "Hint: edit" in msg
    assert err.value.exit_code == EXIT_CONFIG


def test_unknown_section_and_model_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'sever' in the top level .*valid: default_model, "
                       r"\[server\]"):
        load(path=write(tmp_path / "a.toml", "[sever]\nsocket = '/x'\n"))
    with pytest.raises(ConfigError, match=r"'ctx' in \[models.m\] .*valid: path, context"):
        load(path=write(tmp_path / "b.toml", "[models.m]\npath = '/x'\nctx = 3\n"))


def test_section_as_scalar_and_bad_model_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'server' .*must be a table"):
        load(path=write(tmp_path / "a.toml", "server = 3\n"))
    with pytest.raises(ConfigError, match=r"model name 'Big Model' .*not valid"):
        load(path=write(tmp_path / "b.toml", '[models."Big Model"]\npath = "/x"\n'))


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[scheduler]\nqueue_max = 0", r"scheduler\.queue_max .*expected an integer from 1"),
        ("[scheduler]\nqueue_max = true", r"got bool True"),
        ("[runtime]\nmlock = 'always'", r"runtime\.mlock .*one of required, best-effort, off"),
        ("[runtime]\nmemory_budget_bytes = '2 bananas'", r"K/M/G/T"),
        ("[runtime]\nthreads = 0", r"'auto' or an integer from 1"),
        ("[runtime]\ndecode = 'exact'", r"runtime\.decode .*one of batched, alone"),
        ("[server]\nsocket_mode = '0999'", r"octal file mode"),
        ("[server]\nmax_body_bytes = 'max'", r"no limit here"),
        ("[server]\ntcp = 'localhost'", r"HOST:PORT"),
        ("[server]\ntcp = '127.0.0.1:70000'", r"port 70000 out of range"),
        ("[models.smollm2]\npriority = 11", r"models\.smollm2\.priority .*from 0 to 10"),
        ("[models.smollm2]\npreload = 'perhaps'", r"expected true or false"),
    ],
)
def test_bad_values_name_key_source_and_choices(tmp_path: Path, toml: str, expected: str) -> None:
    cfg = write(tmp_path / "c.toml", toml + "\n")
    with pytest.raises(ConfigError, match=expected) as err:
        load(path=cfg)
    assert str(cfg) in str(err.value) and "Hint:" in str(err.value)


def test_tcp_must_be_loopback_unless_allowed(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", "[server]\ntcp = '0.0.0.0:8080'\n")
    with pytest.raises(ConfigError, match=r"not a loopback address.*tcp_allow_remote"):
        load(path=cfg)
    c = load(path=cfg, overrides={"server.tcp_allow_remote": True})
    assert c.server.tcp == "0.0.0.0:8080"
    assert load(overrides={"server.tcp": "[::1]:9000"}).server.tcp == "[::1]:9000"


def test_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model 'other' .*has no path"):
        load(path=write(tmp_path / "a.toml", "[models.other]\ncontext = 64\n"))
    with pytest.raises(ConfigError, match=r"models\.other\.path = '.*missing\.gguf'.*no such file"):
        load(path=write(tmp_path / "b.toml", "[models.other]\npath = 'missing.gguf'\n"),
             check_paths=True)
    with pytest.raises(ConfigError, match=r"default_model = 'ghost' .*configured: smollm2"):
        load(path=write(tmp_path / "c.toml", "default_model = 'ghost'\n"))
    with pytest.raises(ConfigError, match=r"models\.smollm2\.chat_template_file = '.*nope\.jinja' "
                       r"\(from .*d\.toml\): no such file.*Hint: .*point it at a Jinja chat "
                       r"template file, or remove the key"):
        load(path=write(tmp_path / "d.toml", "[models.smollm2]\nchat_template_file = "
                        f"'{tmp_path / 'nope.jinja'}'\n"), check_paths=True)
    with pytest.raises(ConfigError, match=r"chat_template_file = '.*' .*a directory"):
        load(path=write(tmp_path / "e.toml", "[models.smollm2]\nchat_template_file = "
                        f"'{tmp_path}'\n"), check_paths=True)
    t = write(tmp_path / "t.jinja", "{{ messages }}")
    c = load(path=write(tmp_path / "f.toml", f"[models.smollm2]\nchat_template_file = '{t}'\n"),
             check_paths=True)
    assert c.model().chat_template_file == t and c.to_dict()["models"]["smollm2"][
        "chat_template_file"] == str(t)


# ----- board profile layer ---------------------------------------------------------------------


def test_board_layer_and_mcu_rejection(profiles: Path) -> None:
    c = load(board="testboard", profile_dirs=[profiles])
    assert c.scheduler.queue_max == 20 and c.runtime.threads == 2 and c.board == "testboard"
    assert c.sources[-1] == f"board profile {profiles / 'testboard.toml'}"
    with pytest.raises(ConfigError, match=r'kind = "mcu" is an MCU target for `edge-agent flash '
                       r"--board mcuchip`.*host profile to --board here \(testboard\)"):
        load(board="mcuchip", profile_dirs=[profiles])
    with pytest.raises(ConfigError, match=r"'nosuch': no file nosuch\.toml .*testboard"):
        load(board="nosuch", profile_dirs=[profiles])


def test_board_profiles_are_found_in_an_installed_wheels_layout(tmp_path: Path) -> None:
    """`pip install .` puts edge_agent and firmware_tools side by side in site-packages, with
    the profiles as firmware_tools' package data and no board_profiles/ next to them: `serve
    --board rpi5` must find them there (it did not: "host profiles: (none)")."""
    import shutil
    import subprocess
    import sys

    import edge_agent
    import firmware_tools

    site = tmp_path / "site-packages"
    for pkg in (edge_agent, firmware_tools):
        src = Path(pkg.__file__).parent
        shutil.copytree(src, site / src.name, symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__"))
    assert not (site / "board_profiles").exists()
    code = ("import json; from edge_agent.host_profiles import list_host_profiles, "
            "load_host_profile; print(json.dumps(list_host_profiles())); "
            "print(load_host_profile('rpi5').path)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    names, path = r.stdout.splitlines()
    assert {"rpi5", "rk3588", "generic-debian"} <= set(json.loads(names))
    assert path == str(site / "firmware_tools" / "profiles" / "rpi5.toml")


def test_board_profile_errors(profiles: Path) -> None:
    write(profiles / "b1.toml", 'kind = "host"\ndescription = "x"\n[agent]\nruntime.thread = 2\n')
    with pytest.raises(ConfigError, match=r"'thread' in \[runtime\] \(from board profile .*b1"):
        load(board="b1", profile_dirs=[profiles])
    write(profiles / "b2.toml", 'kind = "host"\ndescription = "x"\nthreads = 2\n')
    with pytest.raises(ConfigError, match=r"unknown top-level key\(s\) threads"):
        load(board="b2", profile_dirs=[profiles])
    write(profiles / "b3.toml", 'kind = "hots"\n')
    with pytest.raises(ConfigError, match=r"kind = 'hots', expected \"host\""):
        load(board="b3", profile_dirs=[profiles])
    write(profiles / "b4.toml", 'kind = "host"\n')
    with pytest.raises(ConfigError, match=r"`description` must be a non-empty string"):
        load(board="b4", profile_dirs=[profiles])
    with pytest.raises(ConfigError, match=r"no such file"):
        load(board=str(profiles / "absent.toml"))


def test_board_profile_dir_from_environment(profiles: Path) -> None:
    env = {"EDGE_AGENT_BOARD_PROFILE_DIR": str(profiles)}
    assert load(board="testboard", env=env).scheduler.queue_max == 20


def test_shipped_host_profiles_load() -> None:
    names = list_host_profiles([REPO_PROFILES])
    assert {"rpi5", "rk3588", "generic-debian"} <= set(names)
    for name in names:
        profile = load_host_profile(name, dirs=[REPO_PROFILES])
        assert profile.description and "agent" not in profile.hardware
        c = load(board=name, profile_dirs=[REPO_PROFILES])
        assert c.board == name
    assert load(board="rpi5", profile_dirs=[REPO_PROFILES]).serial.port == "/dev/ttyAMA0"
    assert load(board="rk3588", profile_dirs=[REPO_PROFILES]).runtime.threads == 4


# ----- environment and flags -------------------------------------------------------------------


def test_precedence_file_board_env_flag(tmp_path: Path, profiles: Path) -> None:
    cfg = write(tmp_path / "c.toml", "[scheduler]\nqueue_max = 10\nmax_retries = 5\n")
    env = {"EDGE_AGENT_SCHEDULER__QUEUE_MAX": "30"}
    assert load(path=cfg).scheduler.queue_max == 10
    assert load(path=cfg, board="testboard", profile_dirs=[profiles]).scheduler.queue_max == 20
    c = load(path=cfg, board="testboard", profile_dirs=[profiles], env=env)
    assert c.scheduler.queue_max == 30 and c.scheduler.max_retries == 5  # keys, not tables
    c = load(path=cfg, board="testboard", profile_dirs=[profiles], env=env,
             overrides={"scheduler.queue_max": 40, "server.socket": None})
    assert c.scheduler.queue_max == 40
    assert c.sources[-2:] == ("environment (EDGE_AGENT_SCHEDULER__QUEUE_MAX)", "flags")


def test_environment_variables() -> None:
    env = {
        "EDGE_AGENT_SERVER__SOCKET": "/tmp/e.sock",
        "EDGE_AGENT_RUNTIME__MLOCK": "off",
        "EDGE_AGENT_SERVER__TCP_ALLOW_REMOTE": "yes",
        "EDGE_AGENT_MODELS__SMOLLM2__CONTEXT": "1024",
        "EDGE_AGENT_MODELS__SMOLLM2__TTL_S": "never",
        "EDGE_AGENT_STATE_DIR": "/tmp/state",  # not a config key: the state-dir variable
        "EDGE_AGENT_SOMETHING_ELSE": "ignored",
        "OTHER": "x",
    }
    c = load(env=env)
    assert c.server.socket == Path("/tmp/e.sock") and c.runtime.mlock == "off"
    assert c.server.tcp_allow_remote is True and c.server.state_dir == Path("/tmp/state")
    assert c.model().context == 1024 and c.model().ttl_s is None


def test_environment_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.queue_max \(from environment variable "
                       r"EDGE_AGENT_SCHEDULER__QUEUE_MAX\): expected an integer.*got str 'lots'"
                       r".*Hint: fix or unset EDGE_AGENT_SCHEDULER__QUEUE_MAX"):
        load(env={"EDGE_AGENT_SCHEDULER__QUEUE_MAX": "lots"})
    with pytest.raises(ConfigError, match=r"'max_queue' in \[scheduler\].*EDGE_AGENT_SCHEDULER__"):
        load(env={"EDGE_AGENT_SCHEDULER__MAX_QUEUE": "3"})
    with pytest.raises(ConfigError, match=r"model 'extra' \(from environment variable "
                       r"EDGE_AGENT_MODELS__EXTRA__CONTEXT\) has no path"):
        load(env={"EDGE_AGENT_MODELS__EXTRA__CONTEXT": "64"})
    with pytest.raises(ConfigError, match=r"default_model = 'nope' \(from environment variable "
                       r"EDGE_AGENT_DEFAULT_MODEL\)"):
        load(env={"EDGE_AGENT_DEFAULT_MODEL": "nope"})
    with pytest.raises(ConfigError, match=r"not models\.NAME\.KEY"):
        load(env={"EDGE_AGENT_MODELS__CONTEXT": "64"})


def test_flag_errors_name_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"server\.socket \(from flag --socket\): expected a "
                       r"non-empty path.*Hint: fix the value given to --socket"):
        load(overrides={"server.socket": ""}, flags={"server.socket": "--socket"})
    with pytest.raises(ConfigError, match=r"'sockets' in \[server\] \(from command-line override "
                       r"server\.sockets\)"):
        load(overrides={"server.sockets": "/x"})


def test_to_dict_round_trips_through_overrides(tmp_path: Path) -> None:
    write(tmp_path / "m.gguf", "x")
    c = load(env={"EDGE_AGENT_RUNTIME__MEMORY_BUDGET_BYTES": "1536M",
                  "EDGE_AGENT_MODELS__M__PATH": str(tmp_path / "m.gguf")})
    d = c.to_dict()
    assert d["runtime"]["memory_budget_bytes"] == 1536 << 20
    assert d["server"]["socket_mode"] == "0660" and d["runtime"]["threads"] == "auto"
    flat = {"default_model": d["default_model"]}
    for section in ("server", "scheduler", "runtime", "serial"):
        flat.update({f"{section}.{k}": v for k, v in d[section].items()})
    for name, entry in d["models"].items():
        flat.update({f"models.{name}.{k}": v for k, v in entry.items()})
    again = load(overrides=flat)
    assert again.to_dict() | {"sources": []} == d | {"sources": []}


def test_cli_exits_78_on_bad_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EDGE_AGENT_SCHEDULER__QUEUE_MAX", "-1")
    assert cli.main(["status"]) == EXIT_CONFIG
    assert "EDGE_AGENT_SCHEDULER__QUEUE_MAX" in capsys.readouterr().err


def _documented_keys(text: str) -> set[str]:
    """Keys named in the first column of markdown tables: `section.key` / `other` rows."""
    keys: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        section = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "." in name:
                section, _, _ = name.rpartition(".")
                keys.add(name)
            elif section:
                keys.add(f"{section}.{name}")
            else:
                keys.add(name)
    return keys


def test_every_key_is_documented() -> None:
    reference = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    documented = _documented_keys(reference.read_text(encoding="utf-8"))
    missing = sorted(key for key in KEYS if key not in documented)
    assert not missing, f"configuration keys missing from docs/configuration.md's table: {missing}"


# ----- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("512M", 512 << 20), ("2G", 2 << 30), ("2GiB", 2 << 30), ("1.5k", 1536), ("4096", 4096),
     (4096, 4096), ("max", None), ("infinity", None), ("1T", 1 << 40), (" 8 mb ", 8 << 20)],
)
def test_parse_size(text: object, value: int | None) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "M", "-1", "1.3", "12X", True, 1.5, -3])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="expected|whole number"):
        parse_size(bad)


def test_format_size() -> None:
    assert [format_size(n) for n in (None, 1 << 30, 1536, 3 << 20, 1000)] == \
        ["max", "1G", "1536", "3M", "1000"]
    for n in (1 << 30, 1536, 3 << 20, 1000, 0):
        assert parse_size(format_size(n)) == n
