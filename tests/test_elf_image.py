"""ELF -> flash image: byte equality with objcopy, every rejection rule, QEMU boot of the bytes."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import firmware
import pytest

from firmware_tools.errors import FirmwareError
from firmware_tools.image import ElfImageError, FlashImage, load_elf
from firmware_tools.profiles import McuProfile, load_profile

F405_FLASH = 0x08000000


@pytest.fixture(scope="session")
def fw(tmp_path_factory: pytest.TempPathFactory) -> firmware.FirmwareBuilder:
    firmware.require(firmware.CC)
    return firmware.builder(tmp_path_factory)


@pytest.fixture(scope="module")
def f405() -> McuProfile:
    return load_profile("stm32f405")


def write_profile(tmp_path: Path, name: str, *, start: int = F405_FLASH, size: int = 0x4000,
                  sector: int = 0x4000, allow: bool = False, extra: str = "") -> McuProfile:
    """A small MCU profile file for edge cases the shipped profiles do not have."""
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'kind = "mcu"\ndescription = "test part"\nchip_ids = [0x413]\n{extra}'
        f"[flash]\nstart = {start:#x}\nsize = {size:#x}\nwrite_unit = 4\n"
        f"allow_unaligned_start = {'true' if allow else 'false'}\n"
        f"sectors = [{{ count = {size // sector}, size = {sector:#x} }}]\n"
        "[[ram]]\nname = \"sram\"\nstart = 0x20000000\nsize = 0x20000\n"
        "[bootloader]\n[reset]\n"
    )
    return load_profile(path)


# --------------------------------------------------------------------------- good images


def test_good_image_is_objcopy_binary(fw: firmware.FirmwareBuilder, f405: McuProfile) -> None:
    image = load_elf(fw.elf("good"), f405)
    oracle = fw.objcopy_bin("good").read_bytes()
    assert image.data == oracle
    assert image.base == F405_FLASH and image.end == F405_FLASH + len(oracle)
    assert image.sha256 == hashlib.sha256(oracle).hexdigest()
    assert image.warnings == ()
    text, data = image.segments
    assert text.sections == (".text",) and text.paddr == text.vaddr == F405_FLASH
    # .data: load address in flash right after .text, run address in RAM, .bss not written.
    assert data.sections == (".data",)
    assert data.paddr == text.end and data.vaddr == 0x20000000
    assert data.memsz > data.filesz
    assert image.size == text.filesz + data.filesz
    assert firmware.GREETING.encode() in image.data[data.paddr - image.base :]


def test_one_mib_elf_matches_objcopy_and_checks_fast(
    fw: firmware.FirmwareBuilder, f405: McuProfile
) -> None:
    elf = fw.elf("big")
    assert elf.stat().st_size > 1_000_000
    image = load_elf(elf, f405)
    assert image.data == fw.objcopy_bin("big").read_bytes()
    best = min(_timed(lambda: load_elf(elf, f405)) for _ in range(3))
    assert best < 0.1, f"checking a 1 MiB ELF took {best * 1000:.1f} ms (budget 100 ms)"


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]  # the callable the caller passes
    return time.perf_counter() - t0


def test_gap_between_segments_is_erased_flash(
    fw: firmware.FirmwareBuilder, f405: McuProfile
) -> None:
    image = load_elf(fw.elf("gap"), f405)
    text, data = image.segments
    assert data.paddr == 0x08000200 and text.end < data.paddr
    gap = image.data[text.end - image.base : data.paddr - image.base]
    assert gap == b"\xff" * (data.paddr - text.end)
    assert image.data == fw.objcopy_bin("gap", gap_fill=0xFF).read_bytes()
    assert image.data != fw.objcopy_bin("gap").read_bytes()  # objcopy's default fill is 0x00


def test_zero_filesz_segment_in_ram_is_skipped(
    fw: firmware.FirmwareBuilder, f405: McuProfile
) -> None:
    from elftools.elf.elffile import ELFFile

    elf = fw.elf("bss_segment")
    with elf.open("rb") as fh:
        loads = [s.header for s in ELFFile(fh).iter_segments() if s["p_type"] == "PT_LOAD"]
    assert any(h.p_filesz == 0 and h.p_paddr >= 0x20000000 for h in loads)
    image = load_elf(elf, f405)
    assert [s.sections for s in image.segments] == [(".text",), (".data",)]
    assert image.data == fw.objcopy_bin("bss_segment").read_bytes()


def test_unaligned_start_allowed_warns_about_erased_bytes(
    fw: firmware.FirmwareBuilder, tmp_path: Path
) -> None:
    profile = write_profile(tmp_path, "lenient", allow=True)
    image = load_elf(fw.elf("misaligned"), profile)
    assert image.base == 0x08000100
    (warning,) = image.warnings
    assert "0x08000000..0x080000FF (256 bytes)" in warning
    assert "sector 0" in warning


# --------------------------------------------------------------------------- rejections

REJECTIONS = [
    # variant, rule, segment, fragments of the message
    ("not_elf", "not-elf", None, ["not an ELF file", "expected b'\\x7fELF'", "Hint:"]),
    ("truncated", "truncated", 0,
     ["segment 0", "0x08000000..0x08000144", "p_filesz 324", "only 162", "Hint:"]),
    ("x86_64", "class", None, ["ELF64", "expected ELF32", "Hint:"]),
    ("big_endian", "endianness", None, ["big endian", "expected little endian", "Hint:"]),
    ("machine", "machine", None, ["EM_386", "expected EM_ARM", "Hint:"]),
    ("object", "type", None, ["ET_REL", "no program headers", "ET_EXEC", "Hint:"]),
    ("headers", "headers-in-segment", 0,
     ["segment 0 (.text)", "0x08000000", "ELF and program headers", "7f 45 4c 46",
      "ORIGIN is not page-aligned", "Hint:"]),
    ("no_at", "outside-flash", 1,
     ["segment 1 (.data)", "0x20000000..0x20000038", "in RAM", "AT> FLASH", "Hint:"]),
    ("overlap", "overlap", 1,
     ["segment 1 (.data)", "0x08000010", "overlaps segment 0 (.text)", "Hint:"]),
    ("misaligned", "unaligned-start", None,
     ["0x08000100", "sector 0 (0x08000000..0x08004000, 16 KiB)",
      "0x08000000..0x080000FF (256 bytes)", "does not allow", "Hint:"]),
]


@pytest.mark.parametrize(("variant", "rule", "segment", "fragments"), REJECTIONS,
                         ids=[r[0] for r in REJECTIONS])
def test_bad_elf_is_rejected_with_its_reason(
    fw: firmware.FirmwareBuilder, f405: McuProfile,
    variant: str, rule: str, segment: int | None, fragments: list[str],
) -> None:
    path = fw.elf(variant)
    with pytest.raises(ElfImageError) as info:
        load_elf(path, f405)
    err = info.value
    assert (err.rule, err.segment) == (rule, segment)
    assert isinstance(err, FirmwareError) and err.exit_code == 1
    message = str(err)
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


@pytest.mark.parametrize(
    ("cut", "fragment"),
    [(30, "shorter than the 52-byte ELF32 header"), (60, "program header table")],
)
def test_file_cut_in_its_headers_is_truncated(
    fw: firmware.FirmwareBuilder, f405: McuProfile, tmp_path: Path, cut: int, fragment: str
) -> None:
    path = tmp_path / "cut.elf"
    path.write_bytes(fw.elf("good").read_bytes()[:cut])
    with pytest.raises(ElfImageError, match=fragment) as info:
        load_elf(path, f405)
    assert info.value.rule == "truncated"


def test_file_cut_in_section_table_is_truncated(
    fw: firmware.FirmwareBuilder, f405: McuProfile, tmp_path: Path
) -> None:
    path = tmp_path / "cut.elf"
    path.write_bytes(fw.elf("good").read_bytes()[:-10])
    with pytest.raises(ElfImageError, match="section header table") as info:
        load_elf(path, f405)
    assert info.value.rule == "truncated"


def test_image_larger_than_flash(fw: firmware.FirmwareBuilder) -> None:
    with pytest.raises(ElfImageError) as info:
        load_elf(fw.elf("big"), load_profile("stm32f103x8"))
    message = str(info.value)
    assert info.value.rule == "too-large" and info.value.segment == 0
    assert "image larger than flash" in message
    assert "1000456 bytes" in message and "(64 KiB) holds 65536" in message


def test_segment_running_past_end_of_flash(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    profile = write_profile(tmp_path, "small", size=0x200, sector=0x100, allow=True)
    with pytest.raises(ElfImageError) as info:
        load_elf(fw.elf("misaligned"), profile)
    assert info.value.rule == "outside-flash" and info.value.segment == 0
    assert "extends 68 bytes past the end of small flash 0x08000000..0x08000200" in str(
        info.value
    )


def test_segment_nowhere_near_flash(fw: firmware.FirmwareBuilder, tmp_path: Path) -> None:
    profile = write_profile(tmp_path, "elsewhere", start=0x00000000, size=0x10000)
    with pytest.raises(ElfImageError) as info:
        load_elf(fw.elf("good"), profile)
    assert info.value.rule == "outside-flash" and info.value.segment == 0
    assert "segment 0 (.text) at load address 0x08000000..0x08000144" in str(info.value)
    assert "outside elsewhere flash 0x00000000..0x00010000" in str(info.value)


def test_unreadable_file(f405: McuProfile, tmp_path: Path) -> None:
    with pytest.raises(ElfImageError, match=r"missing\.elf: cannot read it .*Hint:") as info:
        load_elf(tmp_path / "missing.elf", f405)
    assert info.value.rule == "io"


def test_flash_image_is_frozen(fw: firmware.FirmwareBuilder, f405: McuProfile) -> None:
    image = load_elf(fw.elf("good"), f405)
    assert isinstance(image, FlashImage)
    with pytest.raises(AttributeError):
        image.base = 0  # type: ignore[misc]  # on purpose: a frozen image refuses it


# --------------------------------------------------------------------------- QEMU oracle


@pytest.mark.tools
@pytest.mark.parametrize("source", ["objcopy", "load_elf"])
def test_image_boots_in_qemu(
    fw: firmware.FirmwareBuilder, f405: McuProfile, tmp_path: Path, source: str
) -> None:
    """The .data line reaches USART1 only if the reset handler copied .data from its LMA."""
    firmware.require(firmware.QEMU)
    if source == "objcopy":
        flash_bin = fw.objcopy_bin("good")
    else:
        flash_bin = tmp_path / "image.bin"
        flash_bin.write_bytes(load_elf(fw.elf("gap"), f405).data)
    output = firmware.boot_qemu(flash_bin)
    assert firmware.GREETING in output, f"QEMU printed {output!r}"


def test_example_makefile_builds_a_flashable_elf(
    fw: firmware.FirmwareBuilder, f405: McuProfile, tmp_path: Path
) -> None:
    """The shipped examples/Makefile (what users run) builds the same bytes as the helper."""
    firmware.require("make")
    firmware._run(["make", "-s", "-C", str(firmware.EXAMPLES), f"BUILD={tmp_path}"], tmp_path)
    image = load_elf(tmp_path / "fw.elf", f405)
    assert image.data == (tmp_path / "fw.bin").read_bytes()
    assert image.data == load_elf(fw.elf("good"), f405).data
