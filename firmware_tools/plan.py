"""Flash plan: which sectors to erase and which write chunks to send, for one image and target.

Invariants this module owns:

- Write chunks are at most `chunk_size` (256, the AN3155 Write Memory limit) bytes, start on a
  multiple of `alignment` = max(4, profile.write_unit) (AN3155 wants 4-byte aligned addresses, the
  H7 whole 32-byte flash words), and have a length that is a multiple of it. Padding is 0xFF.
- Chunk boundaries fall on multiples of `chunk_size` in the address space and on sector
  boundaries, so a chunk never straddles a sector: progress can be tracked per sector.
- Chunks that are all 0xFF are not written: the sector is erased first, and erased flash reads
  0xFF. Verification still compares the whole image.
- `sectors` are exactly the sectors the padded image touches, in address order.
- Pure: no I/O; building a plan for a 1 MiB image costs one bytes copy and a pass of slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from firmware_tools.errors import FirmwareError
from firmware_tools.image import FlashImage
from firmware_tools.profiles import McuProfile, Sector

__all__ = ["FlashPlan", "PlanError", "plan_flash", "WRITE_MAX"]

WRITE_MAX = 256  # AN3155: Write Memory carries 1..256 bytes


class PlanError(FirmwareError, ValueError):
    """An image that cannot be planned for this profile (e.g. built for another board)."""


@dataclass(frozen=True)
class FlashPlan:
    """What flashing `image` onto `profile` will do."""

    image: FlashImage
    profile: McuProfile
    sectors: tuple[Sector, ...]  # to erase, in address order
    write_chunks: tuple[tuple[int, bytes], ...]  # (address, data), address order
    total_bytes: int  # bytes sent in Write Memory commands
    start: int  # padded image start (aligned down to `alignment`)
    end: int  # padded image end (aligned up)
    alignment: int
    chunk_size: int
    skipped_blank_chunks: int

    @property
    def erase_bytes(self) -> int:
        return sum(s.size for s in self.sectors)

    def chunks_in(self, sector: Sector) -> tuple[tuple[int, bytes], ...]:
        """The write chunks that fall in `sector` (for per-sector progress and resume)."""
        return tuple(c for c in self.write_chunks if sector.start <= c[0] < sector.end)

    def to_json(self) -> dict[str, Any]:
        """Plain data for `--json`: addresses and sizes are integers."""
        img = self.image
        return {
            "board": self.profile.name,
            "image": {
                "path": img.source,
                "base": img.base,
                "end": img.end,
                "size": img.size,
                "sha256": img.sha256,
                "segments": [
                    {
                        "index": s.index,
                        "load_address": s.paddr,
                        "run_address": s.vaddr,
                        "file_size": s.filesz,
                        "mem_size": s.memsz,
                        "flags": s.flags,
                        "sections": list(s.sections),
                    }
                    for s in img.segments
                ],
            },
            "warnings": list(img.warnings),
            "erase": {
                "sectors": [{"index": s.index, "start": s.start, "size": s.size}
                            for s in self.sectors],
                "bytes": self.erase_bytes,
            },
            "write": {
                "start": self.start,
                "end": self.end,
                "bytes": self.total_bytes,
                "chunks": len(self.write_chunks),
                "chunk_size": self.chunk_size,
                "alignment": self.alignment,
                "skipped_blank_chunks": self.skipped_blank_chunks,
            },
        }

    def format_text(self) -> str:
        """A human-readable plan: segments, sectors to erase, bytes to write, warnings."""
        img, prof = self.image, self.profile
        lines = [
            f"board    {prof.name}: {prof.description}",
            f"image    {img.source or '-'}: {img.size} bytes at "
            f"0x{img.base:08X}..0x{img.end:08X}",
            f"sha256   {img.sha256}",
            "segments",
        ]
        for s in img.segments:
            names = " ".join(s.sections) or "-"
            run = f" run 0x{s.vaddr:08X}" if s.vaddr != s.paddr else ""
            bss = f", +{s.memsz - s.filesz} zero-filled not written" if s.memsz > s.filesz else ""
            lines.append(
                f"  #{s.index:<2} load 0x{s.paddr:08X}..0x{s.end:08X}{run}  {s.filesz} bytes"
                f"{bss}  {s.flags:<3} {names}"
            )
        lines.append(f"erase    {len(self.sectors)} sector{'s' if len(self.sectors) != 1 else ''}"
                     f", {_size(self.erase_bytes)}")
        for run in _runs(self.sectors):
            lines.append(run)
        lines.append(
            f"write    {self.total_bytes} bytes in {len(self.write_chunks)} chunks to "
            f"0x{self.start:08X}..0x{self.end:08X}"
        )
        blank = f", {self.skipped_blank_chunks} all-0xFF chunks skipped" if (
            self.skipped_blank_chunks) else ""
        lines.append(f"         (<= {self.chunk_size} bytes each, {self.alignment}-byte aligned, "
                     f"0xFF padded{blank})")
        lines.extend(f"warning  {w}" for w in img.warnings)
        return "\n".join(lines)


def _size(n: int) -> str:
    if n % (1024 * 1024) == 0 and n:
        return f"{n // (1024 * 1024)} MiB"
    if n % 1024 == 0 and n:
        return f"{n // 1024} KiB"
    return f"{n} bytes"


def _runs(sectors: tuple[Sector, ...]) -> list[str]:
    """One line per run of equal-size sectors (an F1 image may cover hundreds of pages)."""
    out: list[str] = []
    i = 0
    while i < len(sectors):
        j = i
        while j + 1 < len(sectors) and sectors[j + 1].size == sectors[i].size:
            j += 1
        a, b = sectors[i], sectors[j]
        ids = f"#{a.index}" if i == j else f"#{a.index}-#{b.index}"
        out.append(f"  {ids:<10} 0x{a.start:08X}..0x{b.end:08X}  {j - i + 1} x {_size(a.size)}")
        i = j + 1
    return out


def plan_flash(
    image: FlashImage, profile: McuProfile, *, chunk_size: int = WRITE_MAX, skip_blank: bool = True
) -> FlashPlan:
    """Plan erasing and writing `image` (from `load_elf(..., profile)`) onto `profile`."""
    alignment = max(4, profile.write_unit)
    if not 0 < chunk_size <= WRITE_MAX or chunk_size % alignment or WRITE_MAX % chunk_size:
        raise PlanError(
            f"plan for {profile.name}: chunk size {chunk_size} must divide {WRITE_MAX} and be a "
            f"multiple of the {alignment}-byte write alignment. Hint: use the default (256)."
        )
    start = image.base - image.base % alignment
    end = -(-image.end // alignment) * alignment
    if start < profile.flash_start or end > profile.flash_end or not image.data:
        raise PlanError(
            f"plan for {profile.name}: image 0x{image.base:08X}..0x{image.end:08X} does not fit "
            f"flash 0x{profile.flash_start:08X}..0x{profile.flash_end:08X}. Hint: load the ELF "
            "with the same board profile you flash with."
        )
    padded = b"\xff" * (image.base - start) + image.data + b"\xff" * (end - image.end)
    blank = b"\xff" * chunk_size
    chunks: list[tuple[int, bytes]] = []
    skipped = 0
    addr = start
    while addr < end:
        sector = profile.sector_at(addr)
        assert sector is not None  # [start, end) is inside flash
        stop = min(end, (addr // chunk_size + 1) * chunk_size, sector.end)
        data = padded[addr - start : stop - start]
        if skip_blank and data == blank[: len(data)]:
            skipped += 1
        else:
            chunks.append((addr, data))
        addr = stop
    return FlashPlan(
        image=image,
        profile=profile,
        sectors=profile.sectors_covering(start, end),
        write_chunks=tuple(chunks),
        total_bytes=sum(len(c) for _, c in chunks),
        start=start,
        end=end,
        alignment=alignment,
        chunk_size=chunk_size,
        skipped_blank_chunks=skipped,
    )
