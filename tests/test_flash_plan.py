"""Flash plan: sectors to erase, write chunks (size, alignment, padding), JSON and text forms."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import firmware
import pytest

from firmware_tools.image import FlashImage, load_elf
from firmware_tools.plan import FlashPlan, PlanError, plan_flash
from firmware_tools.profiles import load_profile


@pytest.fixture(scope="session")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    firmware.require(firmware.CC)
    return firmware.builder(tmp_path_factory)


def synthetic(base: int, data: bytes) -> FlashImage:
    """An image from bytes (the plan is pure: it needs no ELF for layout edge cases)."""
    return FlashImage(base=base, data=data, segments=(), warnings=(),
                      sha256=hashlib.sha256(data).hexdigest(), source="synthetic")


def check_invariants(plan: FlashPlan) -> None:
    """Chunk rules of AN3155 and of the profile, and that the chunks rebuild the image."""
    mem = bytearray(b"\xff") * (plan.end - plan.start)
    prev_end = plan.start
    for addr, data in plan.write_chunks:
        assert addr >= prev_end, "chunks overlap or are out of order"
        assert 0 < len(data) <= 256
        assert addr % plan.alignment == 0 and len(data) % plan.alignment == 0
        sector = plan.profile.sector_at(addr)
        assert sector is not None and addr + len(data) <= sector.end, "chunk straddles a sector"
        assert sector in plan.sectors
        mem[addr - plan.start : addr - plan.start + len(data)] = data
        prev_end = addr + len(data)
    img = plan.image
    assert bytes(mem[img.base - plan.start : img.end - plan.start]) == img.data
    assert mem[: img.base - plan.start] == b"\xff" * (img.base - plan.start)
    assert mem[img.end - plan.start :] == b"\xff" * (plan.end - img.end)
    assert plan.total_bytes == sum(len(d) for _, d in plan.write_chunks)
    assert plan.sectors == plan.profile.sectors_covering(plan.start, plan.end)


def test_plan_for_example_firmware(fw: firmware.FirmwareBuilder) -> None:
    f405 = load_profile("stm32f405")
    plan = plan_flash(load_elf(fw.elf("good"), f405), f405)
    check_invariants(plan)
    assert [s.index for s in plan.sectors] == [0]
    assert [(a, len(d)) for a, d in plan.write_chunks] == [(0x08000000, 256), (0x08000100, 124)]
    assert plan.total_bytes == 380 and plan.erase_bytes == 16 * 1024


def test_plan_for_one_mib_covers_every_sector_quickly(fw: firmware.FirmwareBuilder) -> None:
    f405 = load_profile("stm32f405")
    t0 = time.perf_counter()
    plan = plan_flash(load_elf(fw.elf("big"), f405), f405)
    elapsed = time.perf_counter() - t0
    check_invariants(plan)
    assert [s.index for s in plan.sectors] == list(range(12))
    assert plan.erase_bytes == 1024 * 1024
    # The blob is mostly zeros, so almost every chunk is written; check + plan stay fast.
    assert plan.total_bytes >= 1_000_000
    assert elapsed < 0.2, f"check + plan of a 1 MiB ELF took {elapsed * 1000:.0f} ms"


def test_h750_writes_whole_32_byte_flash_words(fw: firmware.FirmwareBuilder) -> None:
    h750 = load_profile("stm32h750vb")
    plan = plan_flash(load_elf(fw.elf("good"), h750), h750)
    check_invariants(plan)
    assert plan.alignment == 32
    assert plan.end == 0x08000180  # 380 bytes padded up to 384
    assert plan.write_chunks[-1][1][-4:] == b"\xff" * 4


def test_unaligned_base_is_padded_down(tmp_path: Path) -> None:
    f405 = load_profile("stm32f405")
    plan = plan_flash(synthetic(0x08000102, b"\x11" * 10), f405)
    check_invariants(plan)
    assert plan.write_chunks == ((0x08000100, b"\xff\xff" + b"\x11" * 10),)


def test_blank_chunks_are_skipped_but_counted() -> None:
    f405 = load_profile("stm32f405")
    data = b"\x01" * 256 + b"\xff" * 512 + b"\x02" * 4
    plan = plan_flash(synthetic(0x08000000, data), f405)
    check_invariants(plan)
    assert [a for a, _ in plan.write_chunks] == [0x08000000, 0x08000300]
    assert plan.skipped_blank_chunks == 2 and plan.total_bytes == 260
    full = plan_flash(synthetic(0x08000000, data), f405, skip_blank=False)
    assert len(full.write_chunks) == 4 and full.skipped_blank_chunks == 0


def test_chunks_split_at_sector_boundaries(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(
        'kind = "mcu"\ndescription = "128-byte pages"\nchip_ids = [0x417]\n'
        "[flash]\nstart = 0x08000000\nsize = 0x400\nwrite_unit = 4\n"
        "sectors = [{ count = 8, size = 0x80 }]\n[bootloader]\n[reset]\n"
    )
    tiny = load_profile(path)
    plan = plan_flash(synthetic(0x08000040, bytes(range(256)) * 2), tiny)
    check_invariants(plan)
    assert [len(d) for _, d in plan.write_chunks] == [64, 128, 128, 128, 64]
    assert [s.index for s in plan.sectors] == [0, 1, 2, 3, 4]
    assert plan.chunks_in(tiny.sectors[1]) == (plan.write_chunks[1],)


def test_image_for_another_board_is_refused(fw: firmware.FirmwareBuilder) -> None:
    f405, h750 = load_profile("stm32f405"), load_profile("stm32h750vb")
    image = load_elf(fw.elf("big"), f405)
    with pytest.raises(PlanError, match=r"does not fit flash 0x08000000..0x08020000.*Hint:"):
        plan_flash(image, h750)


@pytest.mark.parametrize("size", [0, 100, 512, 6])
def test_bad_chunk_size(size: int) -> None:
    f405 = load_profile("stm32f405")
    with pytest.raises(PlanError, match="chunk size"):
        plan_flash(synthetic(0x08000000, b"\x00" * 8), f405, chunk_size=size)


def test_json_and_text(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    path = tmp_path / "lenient.toml"
    path.write_text((Path(__file__).resolve().parents[1] / "board_profiles/stm32f405.toml")
                    .read_text().replace("allow_unaligned_start = false",
                                         "allow_unaligned_start = true"))
    profile = load_profile(path)
    plan = plan_flash(load_elf(fw.elf("misaligned"), profile), profile)
    doc = json.loads(json.dumps(plan.to_json()))
    assert doc["board"] == "lenient"
    assert doc["image"]["base"] == 0x08000100 and doc["image"]["sha256"] == plan.image.sha256
    assert [s["sections"] for s in doc["image"]["segments"]] == [[".text"], [".data"]]
    assert doc["image"]["segments"][1]["run_address"] == 0x20000000
    assert doc["erase"] == {"sectors": [{"index": 0, "start": 0x08000000, "size": 16384}],
                            "bytes": 16384}
    assert doc["write"]["bytes"] == plan.total_bytes and doc["write"]["chunk_size"] == 256
    assert len(doc["warnings"]) == 1 and "0x08000000..0x080000FF" in doc["warnings"][0]
    text = plan.format_text()
    assert "erase    1 sector, 16 KiB" in text
    assert "#0         0x08000000..0x08004000  1 x 16 KiB" in text
    assert "run 0x20000000" in text and ".data" in text
    assert "warning  image starts at 0x08000100" in text


def test_text_groups_runs_of_equal_sectors(fw: firmware.FirmwareBuilder) -> None:
    f405 = load_profile("stm32f405")
    text = plan_flash(load_elf(fw.elf("big"), f405), f405).format_text()
    assert "#0-#3      0x08000000..0x08010000  4 x 16 KiB" in text
    assert "#4         0x08010000..0x08020000  1 x 64 KiB" in text
    assert "#5-#11     0x08020000..0x08100000  7 x 128 KiB" in text
