"""Bounded fuzzing (hypothesis) of the file readers: the GGUF reader and the ELF reader.

Properties:
- GGUFFile on a small GGUF (written with the `gguf` package) whose header, metadata or tensor
  infos were mutated (bytes flipped, inserted, deleted, integers overwritten with huge values,
  the file cut) opens or raises ModelFileError naming the path with a Hint; nothing else, and
  the Python heap never grows past a few MiB whatever a length field claims (2^60-byte strings
  and arrays are refused by a bounds check, not attempted);
- load_elf on a mutated ELF (a small synthetic Cortex-M executable with two load segments and a
  section table, and the example firmware when arm-none-eabi-gcc is installed) returns a
  FlashImage or raises ElfImageError naming the path with a Hint; the heap stays bounded.

Budget: 300 examples for the GGUF and 300 for each ELF seed, no deadline; the module runs in
about 5 s.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import write_tiny_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.errors import ModelFileError
from edge_agent.runtime.gguf import GGUFFile
from firmware_tools.image import ElfImageError, FlashImage, load_elf
from firmware_tools.profiles import McuProfile, load_profile

pytestmark = pytest.mark.timeout(180)

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
HEAP_LIMIT = 8 << 20  # bytes of Python heap one parse may allocate (the files are < 16 KiB)
HUGE = [2**60, 2**63, 2**64 - 1, 2**32, 2**32 - 1, 2**31, 0, 1, 5, 255]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ea-zf-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def heap_peak(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, int]:
    """(result, exception, peak Python heap in bytes) of fn()."""
    tracemalloc.start()
    try:
        try:
            return fn(), None, tracemalloc.get_traced_memory()[1]
        except BaseException as exc:  # noqa: BLE001  (the caller asserts on its type)
            return None, exc, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@st.composite
def mutated(draw: st.DrawFn, base: bytes, region: tuple[int, int]) -> bytes:
    """`base` with 1-4 mutations, each at an offset in [region[0], region[1])."""
    data = bytearray(base)
    lo, hi = region
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(lo, max(lo, min(hi, len(data)) - 1)))
        how = draw(st.sampled_from(["flip", "byte", "u64", "u32", "insert", "delete", "cut"]))
        if how == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "byte":
            data[at] = draw(st.integers(0, 255))
        elif how in ("u64", "u32"):
            size = 8 if how == "u64" else 4
            value = draw(st.one_of(st.sampled_from(HUGE), st.integers(0, 2**(8 * size) - 1)))
            data[at:at + size] = (value % 2**(8 * size)).to_bytes(size, "little")
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif how == "delete":
            del data[at:at + draw(st.integers(1, 16))]
        else:
            del data[at:]
            break
    return bytes(data)


# ---- GGUF ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_seed(scratch: Path) -> tuple[bytes, int]:
    """(bytes of a tiny GGUF, where its tensor data starts)."""
    path = scratch / "seed.gguf"
    write_tiny_gguf(path)
    with GGUFFile(path) as g:
        return path.read_bytes(), g.data_offset


def open_gguf(path: Path) -> dict[str, Any]:
    with GGUFFile(path) as g:
        return {name: g.raw(name).nbytes for name in g.tensors}


def check_gguf(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    result, exc, peak = heap_peak(lambda: open_gguf(path))
    if exc is not None:
        assert isinstance(exc, ModelFileError), repr(exc)
        assert str(exc).startswith(f"{path}: "), exc
        assert "Hint:" in str(exc), exc
    else:
        assert isinstance(result, dict)
    assert peak < HEAP_LIMIT, f"{peak} bytes of heap for a {len(data)}-byte file"


@FUZZ
@given(data=st.data())
def test_mutated_gguf_opens_or_is_a_model_file_error(
        scratch: Path, gguf_seed: tuple[bytes, int], data: st.DataObject) -> None:
    base, data_offset = gguf_seed
    check_gguf(scratch / "z.gguf", data.draw(mutated(base, (0, data_offset))))


def gguf_bytes(kvs: bytes, n_kv: int, tensors: bytes = b"", n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors + bytes(64)


def gstr(s: bytes, n: int | None = None) -> bytes:
    return struct.pack("<Q", len(s) if n is None else n) + s


@pytest.mark.parametrize(("body", "n_kv", "fragment"), [
    (gstr(b"k", 2**60), 1, "needs 1152921504606846976 bytes"),  # a key 2^60 bytes long
    (gstr(b"k") + struct.pack("<I", 8) + gstr(b"v", 2**60), 1, "needs 1152921504606846976"),
    (gstr(b"k") + struct.pack("<IIQ", 9, 8, 2**60), 1, "array 'k'"),  # 2^60 strings
    (gstr(b"k") + struct.pack("<IIQ", 9, 6, 2**62), 1, "array 'k'"),  # 2^62 floats
    (gstr(b"k") + struct.pack("<II", 9, 9) + struct.pack("<QI", 1, 9) * 5000, 1, "nested"),
    (gstr(b"general.alignment") + struct.pack("<I", 8) + gstr(b"x"), 1, "general.alignment"),
    (gstr(b"general.alignment") + struct.pack("<IIQ", 9, 4, 1) + bytes(4), 1,
     "general.alignment"),
    (gstr(b"t") + struct.pack("<I", 2**32 - 1), 0, "dimension count"),
], ids=["key-2^60", "string-2^60", "array-of-2^60-strings", "array-2^62", "nested-arrays",
        "alignment-string", "alignment-array", "dims-2^32"])
def test_hostile_gguf_lengths_are_refused_by_bounds_checks(
        scratch: Path, body: bytes, n_kv: int, fragment: str) -> None:
    path = scratch / "hostile.gguf"
    data = (gguf_bytes(b"", 0, body, 1) if fragment == "dimension count"
            else gguf_bytes(body, n_kv))
    path.write_bytes(data)
    _, exc, peak = heap_peak(lambda: open_gguf(path))
    assert isinstance(exc, ModelFileError), repr(exc)
    assert str(exc).startswith(f"{path}: ") and "Hint:" in str(exc), exc
    assert fragment in str(exc), exc
    assert peak < HEAP_LIMIT


# ---- ELF -------------------------------------------------------------------------------------

F405_FLASH = 0x08000000


def synthetic_elf() -> bytes:
    """An ELF32 ARM executable: .text (RX) in flash, .data (RW) run in RAM and loaded from flash
    right after .text, a .shstrtab and the section table; what arm-none-eabi-ld makes, small."""
    text = bytes(range(1, 65)) * 4  # 256 bytes
    data = b"edge-agent" + bytes(22)
    shstr = b"\0.text\0.data\0.shstrtab\0"
    ehsize, phentsize, shentsize = 52, 32, 40
    phoff = ehsize
    text_off = 0x100
    data_off = text_off + len(text)
    shstr_off = data_off + len(data)
    shoff = (shstr_off + len(shstr) + 3) & ~3
    ph = [
        struct.pack("<8I", 1, text_off, F405_FLASH, F405_FLASH, len(text), len(text), 5, 4),
        struct.pack("<8I", 1, data_off, 0x20000000, F405_FLASH + len(text), len(data),
                    len(data) + 64, 6, 4),
    ]
    sh = [
        bytes(shentsize),
        struct.pack("<10I", 1, 1, 6, F405_FLASH, text_off, len(text), 0, 0, 4, 0),
        struct.pack("<10I", 7, 1, 3, 0x20000000, data_off, len(data), 0, 0, 4, 0),
        struct.pack("<10I", 13, 3, 0, 0, shstr_off, len(shstr), 0, 0, 1, 0),
    ]
    ident = b"\x7fELF" + bytes([1, 1, 1, 0]) + bytes(8)
    ehdr = ident + struct.pack("<HHIIIIIHHHHHH", 2, 40, 1, F405_FLASH + 1, phoff, shoff,
                               0x05000200, ehsize, phentsize, len(ph), shentsize, len(sh), 3)
    out = bytearray(ehdr + b"".join(ph))
    out += bytes(text_off - len(out)) + text + data + shstr
    out += bytes(shoff - len(out)) + b"".join(sh)
    return bytes(out)


@pytest.fixture(scope="module")
def f405() -> McuProfile:
    return load_profile("stm32f405")


def elf_seeds() -> list[str]:
    return ["synthetic", "example-firmware"]


@pytest.fixture(scope="module", params=elf_seeds())
def elf_seed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             f405: McuProfile) -> bytes:
    if request.param == "synthetic":
        raw = synthetic_elf()
    else:
        import firmware
        firmware.require(firmware.CC)
        raw = firmware.builder(tmp_path_factory).elf("good").read_bytes()
    path = tmp_path_factory.mktemp("elf") / "seed.elf"
    path.write_bytes(raw)
    image = load_elf(path, f405)  # the seed itself is a good image
    assert isinstance(image, FlashImage) and image.base == F405_FLASH
    return raw


def check_elf(path: Path, data: bytes, profile: McuProfile) -> None:
    path.write_bytes(data)
    result, exc, peak = heap_peak(lambda: load_elf(path, profile))
    if exc is not None:
        assert isinstance(exc, ElfImageError), repr(exc)
        assert str(exc).startswith(f"{path}") and "Hint:" in str(exc), exc
    else:
        assert isinstance(result, FlashImage)
        assert result.size <= profile.flash_size
    assert peak < HEAP_LIMIT + 4 * len(data), f"{peak} bytes of heap for {len(data)} bytes"


@FUZZ
@given(data=st.data())
def test_mutated_elf_loads_or_is_an_elf_image_error(
        scratch: Path, elf_seed: bytes, f405: McuProfile, data: st.DataObject) -> None:
    # headers and tables get most mutations; anywhere in the file the rest
    region = data.draw(st.sampled_from([(0, 0x100), (0, 0x100), (0, len(elf_seed))]))
    check_elf(scratch / "z.elf", data.draw(mutated(elf_seed, region)), f405)
