"""The flash service alone, over small fakes of what the daemon gives it (no daemon, no socket):
its refusals are domain errors carrying their facts, which protocol/api.py maps to the HTTP
answers docs/api.md lists; a job on a `stm32sim://` board pauses the UART users of that board
and resumes them after, whether the job succeeds or fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import firmware
import pytest

from edge_agent.daemon.flashing import FlashRequest, FlashService
from edge_agent.errors import (
    FlashBusy,
    FlashJobNotFound,
    InvalidRequest,
    PortNotOwned,
    ServiceError,
    ShuttingDown,
    UploadFailed,
)
from edge_agent.protocol.api import api_error

pytestmark = [pytest.mark.timeout(120)]
BOARD = "stm32f405"


class FakeUarts:
    """The UART transports as the flash service sees them (`PortUsers`), recording calls."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.open = list(urls)
        self.calls: list[tuple[str, list[str]]] = []

    async def pause(self, same_board: Callable[[str], bool]) -> list[str]:
        paused = [u for u in self.open if same_board(u)]
        self.open = [u for u in self.open if u not in paused]
        self.calls.append(("pause", paused))
        return paused

    async def resume(self, paused: Sequence[str]) -> None:
        self.open += list(paused)
        self.calls.append(("resume", list(paused)))


def sim(root: Path, name: str, knobs: str = "") -> str:
    return f"stm32sim://?chip=f405&state={root / f'{name}.bin'}{knobs}"


def service(state_dir: Path, ports: Sequence[str], uarts: FakeUarts | None = None,
            stopping: list[bool] | None = None) -> FlashService:
    flag = stopping if stopping is not None else [False]
    return FlashService(state_dir, ports=ports, max_body_bytes=8 << 20,
                        stopping=lambda: flag[0], store=lambda: None,
                        port_users=uarts or FakeUarts([]))


def http(exc: ServiceError) -> tuple[int, str, tuple[tuple[str, str], ...]]:
    e = api_error(exc)
    return e.status, e.code, e.headers


@pytest.fixture(scope="module")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    return firmware.builder(tmp_path_factory)


def test_refusals_are_domain_errors_with_their_http_answers(tmp_path: Path) -> None:
    owned = sim(tmp_path, "owned")
    stopping = [False]
    svc = service(tmp_path / "state", [owned, owned], stopping=stopping)
    assert svc.owned_ports() == [owned]  # a port listed twice (flash.ports and serial.port)
    req = FlashRequest(board=BOARD, port=owned + "&nack=0x31", elf_bytes=b"\x7fELF")

    with pytest.raises(PortNotOwned) as not_owned:  # the same board with a knob added
        asyncio.run(svc.submit(req))
    assert not_owned.value.port == req.port and not_owned.value.same_board_as == owned
    assert http(not_owned.value) == (409, "port_not_owned", ())
    assert "flash.ports" in str(not_owned.value) and "Hint:" in str(not_owned.value)

    with pytest.raises(FlashJobNotFound) as unknown:
        svc.get("flash-9")
    assert unknown.value.job_id == "flash-9"
    assert http(unknown.value) == (404, "flash_job_not_found", ())

    stopping[0] = True
    with pytest.raises(ShuttingDown) as down:
        asyncio.run(svc.submit(req))
    assert http(down.value) == (503, "shutting_down", (("retry-after", "5"),))
    assert svc.jobs == {} and svc.newest() is None


def test_an_upload_that_cannot_be_stored_is_507_and_leaves_no_job(
        tmp_path: Path, fw: firmware.FirmwareBuilder) -> None:
    state = tmp_path / "state"
    state.write_text("a file where the state directory should be\n")
    owned = sim(tmp_path, "owned")
    svc = service(state, [owned])
    elf = fw.elf().read_bytes()
    with pytest.raises(UploadFailed) as failed:
        asyncio.run(svc.submit(FlashRequest(board=BOARD, port=owned, elf_bytes=elf)))
    assert http(failed.value) == (507, "upload_failed", ())
    assert str(failed.value).startswith(f"cannot store the {len(elf)}-byte ELF in "
                                        f"{state}/flash/uploads")
    assert "Hint: free space" in str(failed.value)
    assert svc.jobs == {}
    with pytest.raises(UploadFailed):  # not FlashBusy: the port was not left taken
        asyncio.run(svc.submit(FlashRequest(board=BOARD, port=owned, elf_bytes=elf)))


def test_an_elf_the_checks_reject_is_a_400_before_any_job(
        tmp_path: Path, fw: firmware.FirmwareBuilder) -> None:
    owned = sim(tmp_path, "owned")
    svc = service(tmp_path / "state", [owned])
    for variant, why in (("no_at", "outside stm32f405 flash"), ("x86_64", "machine")):
        req = FlashRequest(board=BOARD, port=owned, elf_bytes=fw.elf(variant).read_bytes())
        with pytest.raises(InvalidRequest) as bad:
            asyncio.run(svc.submit(req))
        assert http(bad.value)[:2] == (400, "invalid_request")
        message = str(bad.value)
        assert message.startswith("field 'elf_base64': the uploaded ELF"), message
        assert why in message and "Hint:" in message, message
    # no job, no upload, the port free
    assert svc.jobs == {} and not (tmp_path / "state" / "flash" / "uploads").exists()


def test_a_job_pauses_the_uart_of_its_board_and_resumes_it_whatever_the_outcome(
        tmp_path: Path, fw: firmware.FirmwareBuilder) -> None:
    good, locked, other = sim(tmp_path, "good"), sim(tmp_path, "locked", "&rdp=1"), \
        sim(tmp_path, "other")
    console = good + "&baud=115200"  # a UART console on the board of `good`, other options
    uarts = FakeUarts([console, locked, other])
    svc = service(tmp_path / "state", [good, locked], uarts)
    elf = fw.elf("good").read_bytes()

    async def go() -> tuple[dict, dict, ServiceError]:
        ok = await svc.submit(FlashRequest(board=BOARD, port=good, elf_bytes=elf))
        with pytest.raises(FlashBusy) as busy:  # one job per board
            await svc.submit(FlashRequest(board=BOARD, port=good, elf_bytes=elf))
        bad = await svc.submit(FlashRequest(board=BOARD, port=locked, elf_bytes=elf))
        await svc.wait(100.0)
        return ok.to_dict(), bad.to_dict(), busy.value

    ok, bad, busy = asyncio.run(go())
    assert isinstance(busy, FlashBusy) and busy.port == good and busy.job_id == ok["id"]
    assert http(busy) == (409, "port_busy", (("retry-after", "5"),))
    assert ok["state"] == "done" and ok["result"]["bytes_verified"] > 0, ok
    assert bad["state"] == "failed" and bad["error"]["message"], bad
    for url in (console, locked):  # paused for its job, resumed after success and failure
        assert uarts.calls.count(("pause", [url])) == uarts.calls.count(("resume", [url])) == 1
    assert sorted(uarts.open) == sorted([console, locked, other])  # all back, `other` untouched
    assert not any(svc.uploads.iterdir())  # uploads deleted whatever the outcome
    newest = svc.newest()
    assert newest is not None and newest["id"] == bad["id"] and newest["state"] == "failed"


def test_a_job_outliving_the_stop_wait_ends_at_a_block_and_resumes(
        tmp_path: Path, fw: firmware.FirmwareBuilder) -> None:
    # a 9600-baud board: the flash takes seconds; the daemon's stop waits 0.3 s for it
    slow = sim(tmp_path, "slow", "&baud=9600")
    svc = service(tmp_path / "state", [slow])
    elf = fw.elf("good").read_bytes()

    async def stop_during_a_flash() -> tuple[dict, float, bool]:
        job = await svc.submit(FlashRequest(board=BOARD, port=slow, elf_bytes=elf))
        await asyncio.sleep(0.5)
        t0 = asyncio.get_running_loop().time()
        await svc.wait(0.3)
        waited = asyncio.get_running_loop().time() - t0
        return job.to_dict(), waited, bool(svc._tasks)

    job, waited, still = asyncio.run(stop_during_a_flash())
    # the worker ended at its next block, before the daemon goes on to close the journal
    assert not still and waited < 5.0, waited
    assert job["state"] == "failed", job
    message = job["error"]["message"]
    assert "the daemon stopped before the flash finished" in message
    assert "Hint: flash again with --resume" in message
    # the next start resumes it: the sectors verified before the stop are not written again
    svc2 = service(tmp_path / "state", [slow])

    async def resume() -> dict:
        job = await svc2.submit(FlashRequest(board=BOARD, port=slow, elf_bytes=elf, resume=True))
        await svc2.wait(120.0)
        return job.to_dict()

    done = asyncio.run(resume())
    assert done["state"] == "done", done
    image = fw.objcopy_bin("good").read_bytes()
    assert (tmp_path / "slow.bin").read_bytes()[:len(image)] == image
