"""GatewaySettings: defaults that work, and refusals that name the setting and its variable."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import GatewaySettings, env_name


def test_defaults_are_valid_and_ids_are_unique_per_instance() -> None:
    first, second = GatewaySettings(), GatewaySettings()
    assert first.models == ("sim",)
    assert first.default_model == "sim"
    assert first.max_timeout_ms >= first.default_timeout_ms >= first.min_timeout_ms
    assert re.fullmatch(r"gw-[0-9a-f]{8}", first.gateway_id), first.gateway_id
    assert first.gateway_id != second.gateway_id


def test_env_name_is_the_prefixed_upper_case_field() -> None:
    assert env_name("max_input_chars") == "BATCHWIRE_MAX_INPUT_CHARS"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"default_model": "gpt"}, "BATCHWIRE_DEFAULT_MODEL"),
        ({"models": ()}, "BATCHWIRE_MODELS"),
        ({"models": ("sim", "sim")}, "BATCHWIRE_MODELS"),
        ({"models": ("sim", "bad name")}, "BATCHWIRE_MODELS"),
        ({"default_timeout_ms": 40_000}, "BATCHWIRE_MAX_TIMEOUT_MS"),
        ({"min_timeout_ms": 0}, "min_timeout_ms is 0"),
        ({"min_timeout_ms": 50_000}, "BATCHWIRE_DEFAULT_TIMEOUT_MS"),
        ({"port": 70_000}, "BATCHWIRE_PORT"),
        ({"gateway_id": "has:colon"}, "BATCHWIRE_GATEWAY_ID"),
        ({"max_input_chars": 0}, "BATCHWIRE_MAX_INPUT_CHARS"),
        ({"max_body_bytes": 10}, "BATCHWIRE_MAX_BODY_BYTES"),
        ({"max_inflight": 0}, "BATCHWIRE_MAX_INFLIGHT"),
        ({"max_poll_wait_s": -1.0}, "BATCHWIRE_MAX_POLL_WAIT_S"),
        ({"sse_ping_s": 0.0}, "BATCHWIRE_SSE_PING_S"),
        ({"sse_ping_s": 120.0}, r"sse_ping_s \(BATCHWIRE_SSE_PING_S\) is 120.0; it must be at most 50 s"),
        ({"reply_recheck_s": float("inf")}, "BATCHWIRE_REPLY_RECHECK_S"),
        ({"max_queue_depth": -1}, "BATCHWIRE_MAX_QUEUE_DEPTH"),
        ({"max_batch_tokens": -1}, "BATCHWIRE_MAX_BATCH_TOKENS"),
        ({"rate_limit_per_s": -1.0}, "BATCHWIRE_RATE_LIMIT_PER_S"),
        ({"rate_limit_per_s": float("inf")}, "BATCHWIRE_RATE_LIMIT_PER_S"),
        ({"rate_limit_burst": -1}, "BATCHWIRE_RATE_LIMIT_BURST"),
        ({"request_linger_ms": 1001.0}, "BATCHWIRE_REQUEST_LINGER_MS"),
        ({"api_keys": ("not-a-digest",)}, "BATCHWIRE_API_KEYS"),
        ({"max_header_bytes": 100}, "BATCHWIRE_MAX_HEADER_BYTES"),
        ({"header_timeout_s": 0.0}, "BATCHWIRE_HEADER_TIMEOUT_S"),
        ({"body_timeout_s": float("inf")}, "BATCHWIRE_BODY_TIMEOUT_S"),
        ({"max_connections": 0}, "BATCHWIRE_MAX_CONNECTIONS"),
        ({"cache_ttl_s": 60.0}, "but no model is deterministic .BATCHWIRE_DETERMINISTIC_MODELS."),
    ],
)
def test_invalid_values_are_refused_naming_the_variable(overrides: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        GatewaySettings(**overrides)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"port": "8000"}, "BATCHWIRE_PORT"),
        ({"max_inflight": True}, "BATCHWIRE_MAX_INFLIGHT"),
        ({"models": ["sim"]}, "BATCHWIRE_MODELS"),
        ({"max_poll_wait_s": float("nan")}, "BATCHWIRE_MAX_POLL_WAIT_S"),
    ],
)
def test_unconverted_values_are_refused_naming_the_variable(overrides: dict[str, Any], named: str) -> None:
    with pytest.raises(TypeError, match=named):
        GatewaySettings(**overrides)


def test_settings_are_frozen() -> None:
    settings = GatewaySettings()
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]


def test_the_burst_defaults_to_one_second_of_the_rate() -> None:
    assert GatewaySettings(rate_limit_per_s=2.5).rate_limit_burst_tokens == 3
    assert GatewaySettings(rate_limit_per_s=0.1).rate_limit_burst_tokens == 1
    assert GatewaySettings(rate_limit_per_s=5, rate_limit_burst=50).rate_limit_burst_tokens == 50


def test_the_cli_reads_limits_and_keys_and_keeps_only_digests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from batchwire.cli import build_parser
    from batchwire.role_settings import gateway_settings, shared_settings
    from gateway.edge.auth import digest_of

    keys_file = tmp_path / "keys"
    keys_file.write_text("file-key-0123456789\n")
    monkeypatch.setenv("BATCHWIRE_STACK_ENV", str(tmp_path / "no-stack.env"))
    monkeypatch.setenv("BATCHWIRE_API_KEYS", "env-key-0123456789")
    monkeypatch.setenv("BATCHWIRE_API_KEYS_FILE", str(keys_file))
    monkeypatch.setenv("BATCHWIRE_RATE_LIMIT_PER_S", "7.5")
    args = build_parser().parse_args(["up", "--max-queue-depth", "123", "--rate-limit-burst", "9"])

    settings = gateway_settings(args, shared_settings(args))

    assert (settings.max_queue_depth, settings.rate_limit_per_s, settings.rate_limit_burst) == (123, 7.5, 9)
    assert settings.api_keys == (digest_of("env-key-0123456789"), digest_of("file-key-0123456789"))
    assert "env-key" not in repr(settings)
    assert args.api_keys is None, "the plain keys are dropped once hashed"


def test_the_cli_refuses_a_bad_key_naming_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from batchwire.cli import build_parser
    from batchwire.role_settings import gateway_settings, shared_settings
    from batchwire.settings import SettingsError

    monkeypatch.setenv("BATCHWIRE_STACK_ENV", str(tmp_path / "no-stack.env"))
    args = build_parser().parse_args(["up", "--api-keys", "tiny"])
    with pytest.raises(SettingsError, match="BATCHWIRE_API_KEYS"):
        gateway_settings(args, shared_settings(args))


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_the_cli_reads_the_event_streams_ping_and_longest_life_from_their_variables(
    command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from batchwire.cli import build_parser
    from batchwire.role_settings import gateway_settings, shared_settings

    monkeypatch.setenv("BATCHWIRE_STACK_ENV", str(tmp_path / "no-stack.env"))
    monkeypatch.setenv("BATCHWIRE_SSE_PING_S", "4.5")
    monkeypatch.setenv("BATCHWIRE_SSE_MAX_S", "120")
    args = build_parser().parse_args([command])

    settings = gateway_settings(args, shared_settings(args))

    assert (settings.sse_ping_s, settings.sse_max_s) == (4.5, 120.0), "docs/operations.md names both variables"
    flagged = build_parser().parse_args([command, "--sse-ping-s", "2", "--sse-max-s", "30"])
    assert (flagged.sse_ping_s, flagged.sse_max_s) == (2.0, 30.0)


@pytest.mark.parametrize(
    ("host", "url"),
    [("127.0.0.1", "http://127.0.0.1:8001"), ("::1", "http://[::1]:8001"), ("localhost", "http://localhost:8001")],
)
def test_the_url_a_role_announces_opens_in_a_browser(host: str, url: str) -> None:
    """``--host ::1`` is announced ``http://[::1]:PORT``: ``http://::1:PORT`` names no address."""
    assert GatewaySettings(host=host, port=8001).url == url
