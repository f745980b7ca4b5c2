"""The sharing rule: which requests share an answer, under which key; and the settings that declare it."""

from __future__ import annotations

import pytest

from gateway.settings import GatewaySettings
from gateway.sharing.answer_keys import AnswerKeys, answer_key

MODELS = {"models": ("sim", "echo", "gen"), "default_model": "sim"}


def keys(**settings: object) -> AnswerKeys:
    return AnswerKeys(GatewaySettings(**{**MODELS, **settings}))  # type: ignore[arg-type]


def test_only_deterministic_models_have_a_key() -> None:
    rule = keys(deterministic_models=("sim",))
    assert rule.key(None, "sim", "x") is not None
    assert rule.key(None, "gen", "x") is None, "a model not declared deterministic never shares"
    assert not keys().active, "nothing shares by default"


def test_the_key_separates_owners_models_and_inputs() -> None:
    rule = keys(deterministic_models=("sim", "echo"))
    base = rule.key("tenant-a", "sim", "hello")
    assert base == rule.key("tenant-a", "sim", "hello"), "the same request, the same key"
    others = {
        rule.key("tenant-b", "sim", "hello"),
        rule.key(None, "sim", "hello"),
        rule.key("tenant-a", "echo", "hello"),
    }
    others.add(rule.key("tenant-a", "sim", "hello "))
    assert base not in others and len(others) == 4, "owner, model and input each change the key"


def test_a_public_model_has_one_scope_for_every_owner() -> None:
    rule = keys(deterministic_models=("sim", "echo"), public_models=("sim",))
    assert rule.key("tenant-a", "sim", "q") == rule.key("tenant-b", "sim", "q") == rule.key(None, "sim", "q")
    assert rule.key("tenant-a", "echo", "q") != rule.key("tenant-b", "echo", "q"), "echo stays per owner"


def test_parts_cannot_run_into_each_other() -> None:
    assert answer_key("a", "b|c", "d") != answer_key("a", "b", "c|d")
    assert answer_key("ab", "c", "d") != answer_key("a", "bc", "d")


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"deterministic_models": ("nope",)}, "BATCHWIRE_DETERMINISTIC_MODELS"),
        ({"deterministic_models": ("sim",), "public_models": ("echo",)}, "BATCHWIRE_PUBLIC_MODELS"),
        ({"cache_ttl_s": -1.0}, "BATCHWIRE_CACHE_TTL_S"),
        ({"cache_ttl_s": float("inf")}, "BATCHWIRE_CACHE_TTL_S"),
    ],
)
def test_bad_sharing_settings_name_their_variable(settings: dict[str, object], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        GatewaySettings(**{**MODELS, **settings})  # type: ignore[arg-type]
