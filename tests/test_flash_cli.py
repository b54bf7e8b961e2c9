"""`edge-agent flash ELF` and `edge-agent flash read` through `cli.main`, against the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import firmware
import interrupt
import pytest

from edge_agent.cli import main


@pytest.fixture(scope="module")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    return firmware.builder(tmp_path_factory)


def flash(tmp: Path, elf: Path, port: str, *extra: str) -> int:
    return main(["--state-dir", str(tmp / "state"), "flash", str(elf), "--board", "stm32f405",
                 "--port", port, *extra])


def test_flash_prints_a_summary(fw: firmware.FirmwareBuilder, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "f.bin"
    # a board as the profile wires it (NRST on DTR, BOOT0 on RTS), running its application:
    # the flash resets it into the bootloader itself
    url = f"stm32sim://?chip=f405&reset=dtr&boot0=rts&state={state}"
    assert flash(tmp_path, fw.elf(), url) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"flashed {fw.elf()} to stm32f405 on stm32sim://")
    assert "erased sectors [0]" in out and "started" in out
    assert state.read_bytes().startswith(fw.objcopy_bin().read_bytes())


def test_flash_json_and_no_go(fw: firmware.FirmwareBuilder, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    url = f"stm32sim://?chip=f405&state={tmp_path / 'f.bin'}"
    assert flash(tmp_path, fw.elf(), url, "--json", "--no-go") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["erased"] == [0] and doc["went"] is False
    assert doc["chip_id"] == "0x413" and doc["erase_command"] == "0x44"
    assert doc["bytes_verified"] == fw.objcopy_bin().stat().st_size
    assert flash(tmp_path, fw.elf(), url, "--json") == 0
    again = json.loads(capsys.readouterr().out)
    assert again["skipped"] == [0] and again["bytes_written"] == 0 and again["went"] is True


def test_dry_run_touches_no_port(fw: firmware.FirmwareBuilder, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "f.bin"
    assert flash(tmp_path, fw.elf(), f"stm32sim://?chip=f405&state={state}",
                 "--dry-run", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"] is True and doc["sectors"] == [0] and doc["bytes_written"] == 0
    assert not state.exists()


def test_resume_after_link_drop(fw: firmware.FirmwareBuilder, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "f.bin"
    url = f"stm32sim://?chip=f405&state={state}"
    assert flash(tmp_path, fw.elf(), url + "&drop_after=300") == 1
    err = capsys.readouterr().err
    assert "link dropped" in err and "--resume" in err
    assert list((tmp_path / "state" / "flash").glob("*.json"))
    assert flash(tmp_path, fw.elf(), url, "--resume", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["erased"] == [] and doc["bytes_written"] > 0  # sector 0 was erased before the drop
    assert state.read_bytes().startswith(fw.objcopy_bin().read_bytes())
    assert not list((tmp_path / "state" / "flash").glob("*.json"))


def test_faults_end_with_exit_1_and_a_reason(fw: firmware.FirmwareBuilder, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        "stm32sim://?chip=f103": "chip id is 0x410, but board profile 'stm32f405' expects 0x413",
        "stm32sim://?chip=f405&rdp=1": "readout protection",
        "stm32sim://?chip=f405&corrupt=0x08000020": "byte at 0x08000020 reads",
        "stm32sim://?chip=f405&bogus=1": "simulator option 'bogus' is unknown",
    }
    for url, reason in cases.items():
        assert flash(tmp_path, fw.elf(), url) == 1, url
        err = capsys.readouterr().err
        assert err.startswith("edge-agent: error: ") and reason in err and "Hint:" in err, err
        assert err.count("Hint:") == 1, err  # one hint, the one that applies


def test_flash_read(fw: firmware.FirmwareBuilder, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "f.bin"
    url = f"stm32sim://?chip=f405&state={state}"
    assert flash(tmp_path, fw.elf(), url, "--json") == 0
    capsys.readouterr()
    out = tmp_path / "dump.bin"
    assert main(["flash", "read", "--board", "stm32f405", "--port", url, "--out", str(out),
                 "--address", "0x08000000", "--length", "1024"]) == 0
    assert f"read 1024 bytes to {out}" in capsys.readouterr().err
    assert out.read_bytes() == state.read_bytes()[:1024]


@pytest.mark.parametrize("baud", ["0", "-5"])
def test_a_baud_rate_that_cannot_be_is_a_usage_error(baud: str, fw: firmware.FirmwareBuilder,
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # 0 used to mean "the profile's rate" without a word, -5 a port error naming the port
    with pytest.raises(SystemExit) as exc:
        flash(tmp_path, fw.elf(), "stm32sim://?chip=f405", "--baud", baud)
    assert exc.value.code == 2
    assert f"argument --baud: '{baud}': a baud rate is above 0" in capsys.readouterr().err


def test_failures_with_json_print_one_json_document(fw: firmware.FirmwareBuilder,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # a flash the board refuses, and a check whose profile cannot be loaded: {"ok": false, ...}
    # on stdout, the message on stderr, exit 1 and 78 as without --json
    assert flash(tmp_path, fw.elf(), "stm32sim://?chip=f103", "--json") == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] is False and doc["error"]["code"] == "ChipMismatchError"
    assert "expects 0x413" in doc["error"]["message"] and doc["error"]["message"] in err
    assert main(["flash", "check", str(fw.elf()), "--board", "nosuchboard", "--json"]) == 78
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "nosuchboard" in doc["error"]["message"]


def test_ctrl_c_during_a_flash_is_130_and_names_resume(fw: firmware.FirmwareBuilder,
                                                       tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    url = f"stm32sim://?chip=f405&state={tmp_path / 'f.bin'}&baud=9600"  # seconds per sector
    with subprocess.Popen(  # closed (and killed if need be) whatever happens
            [sys.executable, "-m", "edge_agent", "--state-dir", str(tmp_path / "state"), "flash",
             str(fw.elf("big")), "--board", "stm32f405", "--port", url, "--local"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=interrupt.env(),
            preexec_fn=interrupt.foreground) as proc:
        try:
            # the simulator's flash file appears when the port opens: the flash is under way
            # then (a fixed sleep could land in the interpreter's start on a loaded machine)
            end = time.monotonic() + 60
            while not (tmp_path / "f.bin").exists():
                assert proc.poll() is None and time.monotonic() < end
                time.sleep(0.05)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            out, err = interrupt.finish(proc, 60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "run the same command with --resume to finish it" in err, err
