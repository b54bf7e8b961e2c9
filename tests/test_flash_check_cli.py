"""`edge-agent flash check` end to end through cli.main: output, JSON, exit codes, messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import firmware
import pytest

from edge_agent.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    firmware.require(firmware.CC)
    return firmware.builder(tmp_path_factory)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["flash", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_prints_the_plan(fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str]):
    code, out, err = run(capsys, "check", str(fw.elf("good")), "--board", "stm32f405")
    assert (code, err) == (0, "")
    assert "board    stm32f405:" in out
    assert "#0  load 0x08000000..0x08000144" in out
    assert "#1  load 0x08000144..0x0800017C run 0x20000000" in out
    assert "erase    1 sector, 16 KiB" in out
    assert "write    380 bytes in 2 chunks to 0x08000000..0x0800017C" in out


def test_check_json(fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", str(fw.elf("good")), "--board", "stm32h750vb", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["ok"] is True and doc["board"] == "stm32h750vb"
    assert doc["erase"]["sectors"] == [{"index": 0, "start": 0x08000000, "size": 131072}]
    assert doc["write"]["alignment"] == 32 and doc["write"]["bytes"] == 384


@pytest.mark.parametrize(
    ("variant", "rule", "fragment"),
    [
        ("no_at", "outside-flash", "AT> FLASH"),
        ("headers", "headers-in-segment", "7f 45 4c 46"),
        ("truncated", "truncated", "segment 0"),
        ("object", "type", "ET_REL"),
    ],
)
def test_rejected_elf_exits_1(
    fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str],
    variant: str, rule: str, fragment: str,
) -> None:
    elf = str(fw.elf(variant))
    code, out, err = run(capsys, "check", elf, "--board", "stm32f405")
    assert code == 1 and out == ""
    assert err.startswith(f"edge-agent: error: {elf}: ") and fragment in err and "Hint:" in err
    code, out, err = run(capsys, "check", elf, "--board", "stm32f405", "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and doc["error"]["rule"] == rule
    assert fragment in doc["error"]["message"]


def test_unaligned_start_warning_on_stderr_with_json(
    fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    profile = tmp_path / "lenient.toml"
    profile.write_text((ROOT / "board_profiles/stm32f405.toml").read_text().replace(
        "allow_unaligned_start = false", "allow_unaligned_start = true"))
    code, out, err = run(capsys, "check", str(fw.elf("misaligned")), "--board", str(profile),
                         "--json")
    assert code == 0
    assert err.startswith("edge-agent: warning: image starts at 0x08000100")
    assert json.loads(out)["warnings"]


def test_unknown_board_exits_78(fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str]):
    code, out, err = run(capsys, "check", str(fw.elf("good")), "--board", "stm32f999")
    assert code == 78 and out == ""
    assert "board profile 'stm32f999': no file stm32f999.toml" in err
    assert "stm32f405" in err and "Hint:" in err


def test_invalid_board_file_exits_78(
    fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('kind = "mcu"\nflash_size = 1\n')
    code, _, err = run(capsys, "check", str(fw.elf("good")), "--board", str(bad))
    assert code == 78 and f"board profile {bad}: top level: unknown key 'flash_size'" in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["check", "{elf}"], "no --board given, so the flash geometry is unknown"),
        (["check", "--board", "stm32f405"], "flash check: no ELF given"),
        (["check", "{elf}", "--board", "stm32f405", "--port", "loop://"],
         "flash check: --port cannot be used here"),
        (["check", "{elf}", "--board", "stm32f405", "--out", "x.bin", "--resume"],
         "--resume, --out cannot be used here"),
        (["{elf}"], "flash ELF: no --board given"),
        (["{elf}", "--board", "stm32f405"], "flash: no --port given"),
        (["{elf}", "extra.elf", "--board", "stm32f405"], "unexpected second argument"),
        (["{elf}", "--board", "stm32f405", "--out", "x.bin"], "flash ELF: --out cannot be used"),
        (["read", "--board", "stm32f405", "--port", "loop://"], "--port and --out are required"),
        (["read", "--board", "stm32f405", "--dry-run"], "flash read: --dry-run cannot be used"),
        (["read", "{elf}"], "flash read: unexpected argument"),
        (["read", "--port", "loop://", "--out", "x.bin"], "flash read: no --board given"),
    ],
)
def test_usage_errors_exit_2(
    fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str],
    argv: list[str], fragment: str,
) -> None:
    elf = str(fw.elf("good"))
    code, out, err = run(capsys, *(a.replace("{elf}", elf) for a in argv))
    assert code == 2 and out == ""
    assert fragment in err and "Hint:" in err


def test_board_hint_lists_profiles(
    fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, err = run(capsys, "check", str(fw.elf("good")))
    assert "one of: stm32f103x6, stm32f103x8" in err and "stm32h750vb" in err


def test_bad_number_is_an_argparse_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["flash", "read", "--board", "stm32f405", "--address", "0xZZ"])
    assert info.value.code == 2
    assert "'0xZZ' is not an integer" in capsys.readouterr().err


def test_help_documents_the_three_forms(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["flash", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for form in ("edge-agent flash check ELF --board NAME", "edge-agent flash ELF [--board NAME]",
                 "edge-agent flash read --board NAME --port URL --out FILE", "./check"):
        assert form in out


def test_dry_run_needs_no_port(fw: firmware.FirmwareBuilder, capsys: pytest.CaptureFixture[str]):
    code, out, err = run(capsys, str(fw.elf("good")), "--board", "stm32f405", "--dry-run")
    assert code == 0, err
    assert "dry run:" in out and "nothing written" in out


def test_process_exit_codes(fw: firmware.FirmwareBuilder) -> None:
    """The real entry point: exit status and streams as a shell script sees them."""
    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "edge_agent", "flash", *argv],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    ok = cli("check", str(fw.elf("good")), "--board", "stm32f405", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    bad = cli("check", str(fw.elf("no_at")), "--board", "stm32f405")
    assert bad.returncode == 1 and "AT> FLASH" in bad.stderr and bad.stdout == ""
