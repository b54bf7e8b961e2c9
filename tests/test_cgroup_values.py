"""edge_agent.cgroup.values: policy limits, kernel-bound values, PSI triggers."""

from __future__ import annotations

import pytest

from edge_agent.cgroup.values import (
    CgroupValueError,
    Limit,
    check_write,
    parse_limit,
    parse_trigger,
    resolve,
    to_kernel,
)
from edge_agent.errors import ConfigError


@pytest.mark.parametrize("value, expected", [
    (0, Limit(bytes=0)), (4096, Limit(bytes=4096)), ("512M", Limit(bytes=512 << 20)),
    ("2G", Limit(bytes=2 << 30)), ("1.5K", Limit(bytes=1536)), ("max", Limit()),
    ("1.25x", Limit(factor=1.25)), ("140%", Limit(factor=1.4)), ("2X", Limit(factor=2.0)),
])
def test_parse_limit_accepts(value: object, expected: Limit) -> None:
    assert parse_limit(value, where="f.toml: model.memory_max") == expected


@pytest.mark.parametrize("value, needle", [
    ("abc", "'abc'"), (-1, ">= 0"), (True, "boolean"), ("0x", "above zero"), ("1.5", "whole"),
    ([1], "list"),
])
def test_parse_limit_rejects_naming_file_and_key(value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_limit(value, where="cgroups/x.toml: model.memory_max")
    msg = str(e.value)
    assert msg.startswith("cgroups/x.toml: model.memory_max: ")
    assert needle in msg and "Hint:" in msg


def test_relative_refused_where_there_is_no_budget() -> None:
    with pytest.raises(ConfigError, match=r"supervisor.memory_low: '1.2x' is relative"):
        parse_limit("1.2x", where="p.toml: supervisor.memory_low", relative=False)


def test_resolve_rounds_up_to_pages_and_needs_a_budget() -> None:
    assert resolve(Limit(factor=1.1), 1000) == 4096
    assert resolve(Limit(factor=1.0), 8192) == 8192
    assert resolve(Limit(bytes=5000), None) == 8192
    assert resolve(Limit(), 123) is None
    with pytest.raises(ConfigError, match=r"model.memory_high: 1.1x budget needs the model's "
                       r"budget.*--budget"):
        resolve(Limit(factor=1.1), None, where="model.memory_high")
    assert to_kernel(None) == "max" and to_kernel(8192) == "8192"


@pytest.mark.parametrize("name, value", [
    ("memory.max", "max"), ("memory.max", "1073741824"), ("memory.high", "0"),
    ("memory.swap.max", "0"), ("memory.min", "33554432"), ("memory.low", "max"),
    ("memory.oom.group", "1"), ("memory.oom.group", "0"), ("cgroup.procs", "123"),
    ("cgroup.subtree_control", "+memory"), ("cgroup.subtree_control", "+memory -pids"),
    ("memory.pressure", "some 150000 1000000"), ("cgroup.kill", "1"),
])
def test_check_write_accepts_what_the_kernel_accepts(name: str, value: str) -> None:
    check_write(name, value)


@pytest.mark.parametrize("name, value, expect", [
    ("memory.max", "abc", "a byte count or 'max'"), ("memory.max", "-1", "a byte count"),
    ("memory.high", "1G", "a byte count"), ("memory.oom.group", "2", "0 or 1"),
    ("memory.oom.group", "true", "0 or 1"), ("cgroup.procs", "self", "one process id"),
    ("cgroup.subtree_control", "memory", "'+memory'"), ("cgroup.subtree_control", "", "+memory"),
    ("cgroup.kill", "0", "1"),
])
def test_check_write_refuses_what_the_kernel_would_reject(name: str, value: str,
                                                           expect: str) -> None:
    with pytest.raises(CgroupValueError) as e:
        check_write(name, value)
    msg = str(e.value)
    assert msg.startswith(f"{name} <- {value!r}: the kernel would reject it (EINVAL)")
    assert expect in msg and "Hint:" in msg


def test_check_write_refuses_files_we_never_write() -> None:
    with pytest.raises(CgroupValueError, match="memory.reclaim <- '1': edge-agent does not "
                       "write this file"):
        check_write("memory.reclaim", "1")


def test_triggers() -> None:
    t = parse_trigger("some 150000 1000000")
    assert (t.kind, t.stall_us, t.window_us, str(t)) == ("some", 150000, 1000000,
                                                         "some 150000 1000000")
    assert str(parse_trigger("full 500000 500000")) == "full 500000 500000"
    cases = {"some 1 100": "window 100 us is outside 500000..10000000",
             "some 0 1000000": "stall 0 us must be above 0",
             "some 2000000 1000000": "at most the window",
             "half 1 1000000": "is not `some|full STALL_US WINDOW_US`",
             "some 1.5 1000000": "is not `some|full",
             "some 100 20000000": "outside"}
    for text, needle in cases.items():
        with pytest.raises(ConfigError) as e:
            parse_trigger(text, where="p.toml: pressure.trigger")
        assert str(e.value).startswith("p.toml: pressure.trigger: ") and needle in str(e.value)
    with pytest.raises(CgroupValueError, match=r"memory.pressure <- 'some 1 100'.*window"):
        check_write("memory.pressure", "some 1 100")
