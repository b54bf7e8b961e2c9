"""ELF executable -> flash image, with the checks that keep a bad link from reaching flash.

Invariants this module owns:

- The image is built from PT_LOAD segments with file data (p_filesz > 0), placed at their
  physical (load) address p_paddr: `.data` is taken at its LMA in flash, never at its VMA in RAM.
  The memsz - filesz tail (`.bss`) is not written. Zero-filesz segments are skipped.
- Gaps between segments are 0xFF (erased flash), never 0x00. For a firmware whose segments are
  contiguous the bytes equal `arm-none-eabi-objcopy -O binary`.
- A `FlashImage` only exists for an ELF that passed every check against one `McuProfile`:
  ELF32, little endian, the profile's machine, ET_EXEC, no truncated segment, no ELF/program
  header bytes inside a load segment, every segment inside flash, no overlap, image no larger
  than flash, start on an erase-unit boundary (or a warning, if the profile allows it).
- Every rejection is an `ElfImageError` whose `rule` names the check and whose message names the
  segment (program header index), its addresses and the rule, and ends with a `Hint:`.
- An ELF is read up to `elf_read_limit(profile)` bytes (the profile's flash size plus
  ELF_EXTRA_BYTES), never more: a larger file, or a pipe or device (/dev/zero) that gives more,
  is rejected (rule "too-large") naming the path and the limit; a directory is named as one.
- Segment bytes come from slicing the file (pyelftools parses headers only), so a short read
  can never go unnoticed and a 1 MiB image costs a few bytearray copies.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
from dataclasses import dataclass

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from firmware_tools.errors import FirmwareError
from firmware_tools.profiles import McuProfile

__all__ = ["ElfImageError", "FlashImage", "SegmentInfo", "elf_image", "load_elf"]

ELF_MAGIC = b"\x7fELF"
ELF_EXTRA_BYTES = 64 << 20  # read limit beyond the flash size: headers, symbols, debug sections
ELF32_EHDR_SIZE = 52
_CLASSES = {1: "ELF32", 2: "ELF64"}
_ENDIAN = {1: "little endian", 2: "big endian"}
_TYPES = {
    "ET_REL": "a relocatable object (.o) with no program headers, so nothing says where it goes",
    "ET_DYN": "a shared object or position-independent executable",
    "ET_CORE": "a core dump",
    "ET_NONE": "an ELF file of no type",
}


class ElfImageError(FirmwareError, ValueError):
    """An ELF file that must not be flashed. `rule` is a short machine-readable name of the check
    that failed (e.g. 'outside-flash'); `segment` is the program header index, if one is at fault.
    """

    def __init__(self, message: str, *, rule: str, segment: int | None = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.segment = segment


@dataclass(frozen=True)
class SegmentInfo:
    """One PT_LOAD segment that contributes bytes to the image."""

    index: int  # program header index in the ELF
    paddr: int  # load address (LMA): where its bytes go in flash
    vaddr: int  # run address (VMA): differs from paddr for .data
    offset: int  # file offset of its bytes
    filesz: int  # bytes written to flash
    memsz: int  # bytes at run time; memsz - filesz is zero-filled (.bss), not written
    flags: str  # 'R', 'W', 'X' letters
    sections: tuple[str, ...] = ()

    @property
    def end(self) -> int:
        """First flash address after this segment's bytes."""
        return self.paddr + self.filesz


@dataclass(frozen=True)
class FlashImage:
    """Bytes to place in flash from `base`, plus where they came from."""

    base: int
    data: bytes
    segments: tuple[SegmentInfo, ...]
    warnings: tuple[str, ...]
    sha256: str
    source: str = ""
    profile_name: str = ""

    @property
    def end(self) -> int:
        return self.base + len(self.data)

    @property
    def size(self) -> int:
        return len(self.data)


def _seg_text(seg: SegmentInfo) -> str:
    names = f" ({', '.join(seg.sections)})" if seg.sections else ""
    return (
        f"segment {seg.index}{names} at load address 0x{seg.paddr:08X}..0x{seg.end:08X} "
        f"({seg.filesz} bytes)"
    )


def _flash_text(profile: McuProfile) -> str:
    return (
        f"{profile.name} flash 0x{profile.flash_start:08X}..0x{profile.flash_end:08X} "
        f"({_size(profile.flash_size)})"
    )


def _size(n: int) -> str:
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} bytes"


def _flags(p_flags: int) -> str:
    return "".join(c for bit, c in ((4, "R"), (2, "W"), (1, "X")) if p_flags & bit)


def elf_read_limit(profile: McuProfile) -> tuple[int, str]:
    """The most bytes an ELF for `profile` is read up to, and why."""
    why = (f"the {profile.name} flash ({_size(profile.flash_size)}) plus "
           f"{_size(ELF_EXTRA_BYTES)} for ELF headers, symbols and debug sections")
    return profile.flash_size + ELF_EXTRA_BYTES, why


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "a special file"


def _read_upto(fh: io.BufferedReader, most: int, size_hint: int) -> bytes:
    """Up to `most` bytes, asked for in pieces of the file's size + 1 (at least 1 MiB):
    read(n) allocates n bytes before it reads, so read(most) would cost the whole limit
    (flash + 64 MiB) for a 4 KiB ELF. A FIFO or device (/dev/zero) stops at `most` too."""
    buf = bytearray()
    step = max(size_hint + 1, 1 << 20)
    while len(buf) < most:
        piece = fh.read(min(step, most - len(buf)))
        if not piece:
            break
        buf += piece
    return bytes(buf)


def _read(path: str | os.PathLike[str], profile: McuProfile) -> bytes:
    """The file's bytes, never more than `elf_read_limit` (a device or pipe is read up to it)."""
    name = os.fspath(path)
    limit, why = elf_read_limit(profile)
    too_big = ("Hint: check the path to the firmware ELF; if it is one, strip its debug "
               "sections (arm-none-eabi-strip -g) or use a board profile with more flash.")
    try:
        with open(name, "rb") as fh:
            st = os.fstat(fh.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(21, "Is a directory")
            if stat.S_ISREG(st.st_mode) and st.st_size > limit:
                raise ElfImageError(
                    f"{name}: {st.st_size} bytes, more than the {limit} bytes an ELF for "
                    f"{profile.name} may have ({why}). {too_big}",
                    rule="too-large",
                )
            data = _read_upto(fh, limit + 1, st.st_size if stat.S_ISREG(st.st_mode) else 0)
    except OSError as exc:
        what = exc.strerror or str(exc)
        if isinstance(exc, IsADirectoryError):
            what = "it is a directory, not an ELF file"
        raise ElfImageError(
            f"{name}: cannot read it ({what}). Hint: check the path to the firmware ELF.",
            rule="io",
        ) from exc
    if len(data) > limit:
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
        raise ElfImageError(
            f"{name} ({kind}): reading stopped at the limit of {limit} bytes for an ELF for "
            f"{profile.name} ({why}). {too_big}",
            rule="too-large",
        )
    return data


def _check_ident(name: str, data: bytes, profile: McuProfile) -> None:
    if data[:4] != ELF_MAGIC:
        raise ElfImageError(
            f"{name}: not an ELF file (magic {data[:4]!r}, expected {ELF_MAGIC!r}). "
            "Hint: pass the linker's ELF output (e.g. build/fw.elf), not a .bin or .hex file.",
            rule="not-elf",
        )
    if len(data) < ELF32_EHDR_SIZE:
        raise ElfImageError(
            f"{name}: truncated ELF file ({len(data)} bytes, shorter than the "
            f"{ELF32_EHDR_SIZE}-byte ELF32 header). Hint: rebuild or copy the file again.",
            rule="truncated",
        )
    ei_class, ei_data = data[4], data[5]
    if ei_class != 1:
        raise ElfImageError(
            f"{name}: wrong ELF class {_CLASSES.get(ei_class, ei_class)}, expected ELF32 for "
            f"{profile.name} (a 32-bit Cortex-M). Hint: this was built for another machine; "
            "build with arm-none-eabi-gcc.",
            rule="class",
        )
    if ei_data != 1:
        raise ElfImageError(
            f"{name}: wrong endianness ({_ENDIAN.get(ei_data, ei_data)}), expected little "
            f"endian for {profile.name}. Hint: build without -mbig-endian.",
            rule="endianness",
        )


def _check_header(name: str, elf: ELFFile, size: int, profile: McuProfile) -> None:
    hdr = elf.header
    if hdr.e_type != "ET_EXEC":
        what = _TYPES.get(str(hdr.e_type), f"ELF type {hdr.e_type}")
        raise ElfImageError(
            f"{name}: {what} ({hdr.e_type}), expected an executable (ET_EXEC). "
            "Hint: link it with its linker script, e.g. "
            "`arm-none-eabi-gcc -nostdlib -T board.ld -o fw.elf *.o`.",
            rule="type",
        )
    if hdr.e_machine != profile.elf_machine:
        raise ElfImageError(
            f"{name}: built for machine {hdr.e_machine}, expected {profile.elf_machine} for "
            f"{profile.name}. Hint: build with the target's cross compiler (arm-none-eabi-gcc).",
            rule="machine",
        )
    if hdr.e_phnum == 0:
        raise ElfImageError(
            f"{name}: no program headers, so nothing says where the bytes go in flash. "
            "Hint: link the firmware into an executable with its linker script.",
            rule="no-segments",
        )
    ph_end = hdr.e_phoff + hdr.e_phnum * hdr.e_phentsize
    if ph_end > size:
        raise ElfImageError(
            f"{name}: truncated: program header table at file offset 0x{hdr.e_phoff:X}.."
            f"0x{ph_end:X} but the file has {size} bytes. Hint: rebuild or copy the file again.",
            rule="truncated",
        )


def _section_spans(elf: ELFFile) -> list[tuple[str, int, int]]:
    spans = []
    for sec in elf.iter_sections():
        h = sec.header
        if h.sh_type != "SHT_NOBITS" and h.sh_flags & 0x2 and h.sh_size:  # SHF_ALLOC
            spans.append((sec.name, h.sh_offset, h.sh_offset + h.sh_size))
    return spans


def _segments(name: str, elf: ELFFile, size: int) -> list[SegmentInfo]:
    hdr = elf.header
    sh_end = hdr.e_shoff + hdr.e_shnum * hdr.e_shentsize
    sh_ok = 0 < hdr.e_shoff and sh_end <= size
    spans = _section_spans(elf) if sh_ok else []
    ph_end = hdr.e_phoff + hdr.e_phnum * hdr.e_phentsize
    out = []
    for index in range(hdr.e_phnum):
        ph = elf.get_segment(index).header
        if ph.p_type != "PT_LOAD" or ph.p_filesz == 0:
            continue
        seg = SegmentInfo(
            index=index,
            paddr=ph.p_paddr,
            vaddr=ph.p_vaddr,
            offset=ph.p_offset,
            filesz=ph.p_filesz,
            memsz=ph.p_memsz,
            flags=_flags(ph.p_flags),
            sections=tuple(
                n for n, lo, hi in spans if lo >= ph.p_offset and hi <= ph.p_offset + ph.p_filesz
            ),
        )
        available = max(0, size - seg.offset)
        if available < seg.filesz:
            raise ElfImageError(
                f"{name}: truncated: {_seg_text(seg)} needs file bytes 0x{seg.offset:X}.."
                f"0x{seg.offset + seg.filesz:X} (p_filesz {seg.filesz}) but only {available} "
                f"are present (file is {size} bytes). Hint: the file was cut short; rebuild it "
                "or copy it again.",
                rule="truncated",
                segment=index,
            )
        # The ELF header (offset 0) or the program header table inside a load segment: GNU ld
        # does this when the memory ORIGIN leaves room below the first section in its page.
        seg_end = seg.offset + seg.filesz
        if seg.offset < hdr.e_ehsize or (seg.offset < ph_end and seg_end > hdr.e_phoff):
            if seg.offset < 4:
                at = seg.paddr - seg.offset
                what = f"flashing it would write 7f 45 4c 46 ('\\x7fELF') at 0x{at:08X}"
            else:
                what = "flashing it would write header bytes into flash"
            raise ElfImageError(
                f"{name}: {_seg_text(seg)} includes the ELF and program headers (file bytes "
                f"0..0x{ph_end:X}, segment starts at file offset 0x{seg.offset:X}); {what}. "
                "Hint: GNU ld puts the headers in the first segment when the flash ORIGIN is "
                "not page-aligned; align ORIGIN to the sector start, or link with -Wl,-n "
                "(--nmagic), or declare PHDRS without FILEHDR/PHDRS.",
                rule="headers-in-segment",
                segment=index,
            )
        out.append(seg)
    if hdr.e_shoff and not sh_ok:
        raise ElfImageError(
            f"{name}: truncated: section header table at file offset 0x{hdr.e_shoff:X}.."
            f"0x{sh_end:X} but the file has {size} bytes. Hint: rebuild or copy the file again.",
            rule="truncated",
        )
    if not out:
        raise ElfImageError(
            f"{name}: no PT_LOAD segment with file data, nothing to flash. "
            "Hint: check the linker script places .text in flash.",
            rule="no-segments",
        )
    return out


def _check_placement(name: str, segs: list[SegmentInfo], profile: McuProfile) -> None:
    base = min(s.paddr for s in segs)
    end = max(s.end for s in segs)
    for seg in segs:
        if profile.flash_start <= seg.paddr < profile.flash_end:
            if seg.end <= profile.flash_end:
                continue
            if end - base > profile.flash_size:
                raise ElfImageError(
                    f"{name}: image larger than flash: 0x{base:08X}..0x{end:08X} is "
                    f"{end - base} bytes, {_flash_text(profile)} holds {profile.flash_size}; "
                    f"{_seg_text(seg)} ends {seg.end - profile.flash_end} bytes past it. "
                    "Hint: shrink the firmware (-Os, --gc-sections) or pick the larger part.",
                    rule="too-large",
                    segment=seg.index,
                )
            raise ElfImageError(
                f"{name}: {_seg_text(seg)} extends {seg.end - profile.flash_end} bytes past the "
                f"end of {_flash_text(profile)}. Hint: check LENGTH of FLASH in the linker "
                "script against the part's flash size.",
                rule="outside-flash",
                segment=seg.index,
            )
        ram = profile.ram_region_at(seg.paddr)
        if ram is not None:
            raise ElfImageError(
                f"{name}: {_seg_text(seg)} is outside {_flash_text(profile)}: its load address "
                f"is in RAM ({ram.name} 0x{ram.start:08X}..0x{ram.end:08X}, run address "
                f"0x{seg.vaddr:08X}). Hint: the linker script gives this section no load "
                "address in flash; write `> RAM AT> FLASH` for .data so the startup code "
                "copies it from flash.",
                rule="outside-flash",
                segment=seg.index,
            )
        raise ElfImageError(
            f"{name}: {_seg_text(seg)} is outside {_flash_text(profile)}. Hint: check the "
            f"linker script's MEMORY ORIGIN, or the --board ({profile.name}).",
            rule="outside-flash",
            segment=seg.index,
        )
    ordered = sorted(segs, key=lambda s: s.paddr)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.paddr < a.end:
            raise ElfImageError(
                f"{name}: {_seg_text(b)} overlaps {_seg_text(a)} by {a.end - b.paddr} bytes; "
                "one would overwrite the other in flash. Hint: fix the AT()/AT> load "
                "addresses in the linker script.",
                rule="overlap",
                segment=b.index,
            )


def _start_warnings(name: str, base: int, profile: McuProfile) -> tuple[str, ...]:
    sector = profile.sector_at(base)
    assert sector is not None  # placement was checked
    if base == sector.start:
        return ()
    lost = base - sector.start
    where = (
        f"image starts at 0x{base:08X}, {lost} bytes into sector {sector.index} "
        f"(0x{sector.start:08X}..0x{sector.end:08X}, {_size(sector.size)}); erasing that sector "
        f"also erases 0x{sector.start:08X}..0x{base - 1:08X} ({lost} bytes) before the image"
    )
    if not profile.allow_unaligned_start:
        raise ElfImageError(
            f"{name}: {where}, and {profile.name} does not allow an unaligned start. Hint: set "
            f"the flash ORIGIN to a sector start (0x{sector.start:08X}), or, if nothing lives "
            "in those bytes, set allow_unaligned_start = true in the board profile.",
            rule="unaligned-start",
        )
    return (f"{where}; they will read 0xFF afterwards.",)


def load_elf(path: str | os.PathLike[str], profile: McuProfile) -> FlashImage:
    """Read an ELF executable, check it against `profile`, and build its flash image."""
    return elf_image(os.fspath(path), _read(path, profile), profile)


def elf_image(name: str, data: bytes, profile: McuProfile) -> FlashImage:
    """`load_elf` of bytes already read (an upload); `name` is what the errors call it."""
    _check_ident(name, data, profile)
    try:
        elf = ELFFile(io.BytesIO(data))
        _check_header(name, elf, len(data), profile)
        segs = _segments(name, elf, len(data))
    except ELFError as exc:
        raise ElfImageError(
            f"{name}: malformed or truncated ELF ({exc}). Hint: rebuild the firmware.",
            rule="truncated",
        ) from exc
    _check_placement(name, segs, profile)
    base = min(s.paddr for s in segs)
    end = max(s.end for s in segs)
    warnings = _start_warnings(name, base, profile)
    buf = bytearray(b"\xff") * (end - base)
    view = memoryview(data)
    for seg in segs:
        at = seg.paddr - base
        buf[at : at + seg.filesz] = view[seg.offset : seg.offset + seg.filesz]
    image = bytes(buf)
    return FlashImage(
        base=base,
        data=image,
        segments=tuple(segs),
        warnings=warnings,
        sha256=hashlib.sha256(image).hexdigest(),
        source=name,
        profile_name=profile.name,
    )
