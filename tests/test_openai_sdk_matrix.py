"""Every parameter the installed official `openai` SDK can send to chat.completions.create and
completions.create has one documented fate here: honored, accepted and ignored, or refused with
a 400 naming it (protocol/api.py's HONORED_FIELDS, IGNORED_FIELDS, UNSUPPORTED_FIELDS), and
docs/api.md names it. A new SDK release that adds a parameter fails this test until the parameter
is given its fate, so no parameter is ever silently dropped.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from edge_agent.protocol import api

openai = pytest.importorskip("openai")

API_DOC = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
# the SDK's own request options, not body fields
SDK_OPTIONS = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


def _sdk_params(kind: str) -> list[str]:
    if kind == "chat":
        from openai.resources.chat.completions import Completions
    else:
        from openai.resources.completions import Completions
    return [p for p in inspect.signature(Completions.create).parameters if p not in SDK_OPTIONS]


def _fates(kind: str, name: str) -> list[str]:
    fates = []
    if name in api.HONORED_FIELDS[kind]:
        fates.append("honored")
    if name in api.IGNORED_FIELDS and kind in api.IGNORED_FIELDS[name][0]:
        fates.append("ignored")
    if name in api.UNSUPPORTED_FIELDS[kind]:
        fates.append("refused")
    return fates


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_sdk_parameter_has_exactly_one_fate(kind: str) -> None:
    params = _sdk_params(kind)
    assert len(params) > 10  # the SDK's signature was read
    missing = {p: _fates(kind, p) for p in params if len(_fates(kind, p)) != 1}
    assert not missing, (f"openai {openai.__version__} {kind} parameters with no single fate "
                         f"here: {missing}")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_sdk_parameter_is_documented(kind: str) -> None:
    undocumented = [p for p in _sdk_params(kind) if f"`{p}`" not in API_DOC]
    assert not undocumented, f"docs/api.md does not name {undocumented}"


def _body(kind: str, **fields: Any) -> bytes:
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "Hi"}]} if kind == "chat"
                            else {"prompt": "Hi"})
    return json.dumps({**base, **fields}).encode()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_refused_parameters_name_themselves_unless_neutral(kind: str) -> None:
    for name, (neutral, _shown, _planned) in api.UNSUPPORTED_FIELDS[kind].items():
        with pytest.raises(api.ApiError) as info:
            api.parse_generation(_body(kind, **{name: {"not": "neutral"}}), chat=kind == "chat",
                                 max_tokens_limit=64)
        assert info.value.status == 400 and info.value.param == name, name
        assert info.value.code == "unsupported_parameter", name
        assert not neutral({"not": "neutral"})


def test_ignored_parameters_are_type_checked() -> None:
    for name, (kinds, check, wants) in api.IGNORED_FIELDS.items():
        kind = "chat" if "chat" in kinds else "completion"
        bad = 12345 if not check(12345) else ["x"]
        with pytest.raises(api.ApiError) as info:
            api.parse_generation(_body(kind, **{name: bad}), chat=kind == "chat",
                                 max_tokens_limit=64)
        assert info.value.status == 400 and info.value.param == name, name
        assert wants in info.value.message, name
