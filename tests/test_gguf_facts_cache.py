"""A GGUF's header is parsed once per file: `gguf_stamp` names the file (device, inode, size,
mtime), `check_gguf(path, checked=stamp)` skips the parse only for that very file, and
`cached_model_facts` keeps the budget's facts by stamp in the state directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from edge_agent.errors import ModelFileError
from edge_agent.runtime import engines
from edge_agent.runtime.engines import FACTS_CACHE, cached_model_facts, model_facts
from edge_agent.runtime.llama_vocab import check_gguf, gguf_stamp


def test_a_check_is_skipped_for_the_accepted_file_only(tmp_path: Path) -> None:
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)  # a header no parse accepts
    with pytest.raises(ModelFileError, match=str(bad)):
        check_gguf(bad)
    check_gguf(bad, checked=gguf_stamp(bad))  # "this file was accepted": not parsed again
    stamp = gguf_stamp(bad)
    bad.write_bytes(b"GGUF" + b"\xff" * 61)  # another file now: parsed, refused
    with pytest.raises(ModelFileError, match=str(bad)):
        check_gguf(bad, checked=stamp)
    bad.unlink()
    with pytest.raises(ModelFileError, match=str(bad)):  # gone: the parse names it
        check_gguf(bad, checked=stamp)


def test_facts_are_parsed_once_per_file(tmp_path: Path, model_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    shutil.copyfile(model_path, gguf)
    cache = tmp_path / FACTS_CACHE
    facts = cached_model_facts(gguf, cache)
    assert facts == model_facts(gguf) and facts.stamp == gguf_stamp(gguf)
    assert json.loads(cache.read_text())[str(gguf)]["stamp"] == facts.stamp
    parsed: list[Path] = []
    real = engines.model_facts

    def counting(path: Path, metadata: object = None) -> engines.ModelFacts:
        parsed.append(path)
        return real(path)

    monkeypatch.setattr(engines, "model_facts", counting)
    assert cached_model_facts(gguf, cache) == facts and parsed == []  # from the cache
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched
    again = cached_model_facts(gguf, cache)
    assert parsed == [gguf] and again.stamp != facts.stamp and again.n_layers == facts.n_layers
    cache.write_text("{not json")  # unreadable: parsed, rewritten
    assert cached_model_facts(gguf, cache) == again and len(parsed) == 2
    assert json.loads(cache.read_text())[str(gguf)]["stamp"] == again.stamp
    # a cache that cannot be written costs only the parse
    assert cached_model_facts(gguf, tmp_path / "missing" / FACTS_CACHE) == again
