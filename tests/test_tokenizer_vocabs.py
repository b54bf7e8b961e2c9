"""The other pre-tokenizer families against llama.cpp's own tokenizer test data.

tests/data/llamacpp_vocab/ holds, for gpt-2 (`gpt2` regex), llama-bpe (`llama3`, merges ignored
for whole-word tokens), qwen2, starcoder (`smollm`'s regex list on another vocabulary) and
deepseek-coder, the vocab-only GGUF llama.cpp ships in its models/ folder (xz-compressed here)
and the .inp/.out pair its tokenizer test (test-tokenizer-0) checks against: 46 strings
(whitespace runs, tabs and newlines, CJK, emoji, digit runs, apostrophes, code, Cyrillic) and the
ids expected for each, without special tokens. Copied from the llama-cpp-python 0.3.36 sdist on
PyPI; MANIFEST.json records the sdist's and each GGUF's sha256. The SmolLM2 vocabulary itself is
checked on 461 strings in test_tokenizer.py.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

import pytest

from edge_agent.runtime.gguf import GGUFFile
from edge_agent.runtime.tokenizer import PRE_TOKENIZERS, Tokenizer

VOCABS = Path(__file__).parent / "data" / "llamacpp_vocab"
MANIFEST = json.loads((VOCABS / "MANIFEST.json").read_text("utf-8"))
SEPARATOR = "\n__ggml_vocab_test__\n"
# vocab -> its `tokenizer.ggml.pre`, and the regex family of PRE_TOKENIZERS it must select
FAMILY = {"gpt-2": ("gpt-2", "gpt2"), "llama-bpe": ("llama-bpe", "llama3"),
          "qwen2": ("qwen2", "qwen2"), "starcoder": ("starcoder", "smollm"),
          "deepseek-coder": ("deepseek-coder", "deepseek-coder")}


def cases(name: str) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs of one vocab, parsed as test-tokenizer-0 does: texts separated by
    SEPARATOR (the file ends with one), one line of space-separated ids per text."""
    texts = (VOCABS / f"ggml-vocab-{name}.gguf.inp").read_text("utf-8").split(SEPARATOR)
    assert texts[-1] == "", f"{name}.inp does not end with the separator"
    lines = (VOCABS / f"ggml-vocab-{name}.gguf.out").read_text("utf-8").split("\n")
    assert lines[-1] == "", f"{name}.out does not end with a newline"
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines), name
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("llamacpp-vocab")
    paths = {}
    for name in FAMILY:
        data = lzma.decompress((VOCABS / f"ggml-vocab-{name}.gguf.xz").read_bytes())
        (out / f"{name}.gguf").write_bytes(data)
        paths[name] = out / f"{name}.gguf"
    return paths


@pytest.fixture(scope="module")
def metadata(vocab_files: dict[str, Path]) -> dict[str, dict]:
    found = {}
    for name, path in vocab_files.items():
        with GGUFFile(path) as g:
            found[name] = dict(g.metadata)
    return found


@pytest.fixture(scope="module")
def tokenizers(metadata: dict[str, dict]) -> dict[str, Tokenizer]:
    """Each vocabulary's tokenizer, with the family its GGUF names."""
    return {name: Tokenizer.from_metadata(md, source=f"ggml-vocab-{name}.gguf")
            for name, md in metadata.items()}


def test_vocabs_are_the_ones_llamacpp_ships(vocab_files: dict[str, Path]) -> None:
    assert set(MANIFEST["vocabs"]) == set(FAMILY)
    for name, path in vocab_files.items():
        data = path.read_bytes()
        assert len(data) == MANIFEST["vocabs"][name]["gguf_bytes"], name
        assert hashlib.sha256(data).hexdigest() == MANIFEST["vocabs"][name]["gguf_sha256"], name
        assert len(cases(name)) >= 40, name


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_each_vocab_selects_the_family_under_test(name: str, metadata: dict[str, dict]) -> None:
    pre, family = FAMILY[name]
    assert metadata[name]["tokenizer.ggml.model"] == "gpt2"
    assert metadata[name]["tokenizer.ggml.pre"] == pre
    assert PRE_TOKENIZERS[pre] == PRE_TOKENIZERS[family]


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_encode_matches_llamacpp(name: str, tokenizers: dict[str, Tokenizer]) -> None:
    results = [(text, tokenizers[name].encode(text), ids) for text, ids in cases(name)]
    assert [r for r in results if r[1] != r[2]] == []


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_decode_round_trips(name: str, tokenizers: dict[str, Tokenizer]) -> None:
    for text, ids in cases(name):
        assert tokenizers[name].decode(ids) == text, repr(text)


# Families that reproduce every case of a vocab besides its own. Qwen2's vocabulary has no
# multi-digit tokens, so the llama3 list (digits in runs of up to three, whole words looked up
# before merging) tokenizes it exactly like qwen2's own list (one digit at a time). On
# DeepSeek Coder's vocabulary these 46 strings come out the same under its list and three
# others; on the other vocabularies its list fails 6-17 of them. Its regexes are llama.cpp's,
# character for character.
ALSO_MATCHES = {"qwen2": {"llama3"}, "deepseek-coder": {"llama3", "qwen2", "smollm"}}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_cases_tell_the_families_apart(name: str, metadata: dict[str, dict]) -> None:
    """With any other family's regexes (and merge rule) on the same vocabulary, some case comes
    out different (ALSO_MATCHES says where not), so the match above is the regex list's doing,
    not only the merges'."""
    matching = set()
    for family in ("gpt2", "llama3", "qwen2", "smollm", "default", "deepseek-coder"):
        tok = Tokenizer.from_metadata(dict(metadata[name], **{"tokenizer.ggml.pre": family}))
        if all(tok.encode(text) == ids for text, ids in cases(name)):
            matching.add(family)
    assert matching == {FAMILY[name][1]} | ALSO_MATCHES.get(name, set())
