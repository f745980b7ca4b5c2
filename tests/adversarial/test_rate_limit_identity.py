"""Rate limits without API keys: a client cannot spend another client's bucket by naming it.

The bucket is the peer's address unless ``--trust-client-id`` says a proxy in front sets
``X-Client-Id``. Clients get distinct addresses from the loopback network (127.0.0.2, 127.0.0.3
...), so the gateway sees them as different peers, as it would see different hosts.
"""

from __future__ import annotations

import math
import time
import uuid

import httpx
import pytest

from tests.support.adversarial_rig import Service, ServiceFactory, unharmed

pytestmark = pytest.mark.slow

RATE_PER_S = 3.0
BURST = 3
RATE_FLAGS = ("--rate-limit-per-s", str(RATE_PER_S), "--rate-limit-burst", str(BURST))
PROBE_RATE_PER_S = 2.0  # the normal client (127.0.0.1) stays under its own limit
ATTACKER = "127.0.0.2"
VICTIM = "127.0.0.3"
VICTIM_ID = "victim-client"
ATTACK_SUBMITS = 45
ATTACK_PERIOD_S = 1 / 30


def client_at(service: Service, address: str) -> httpx.Client:
    """A client whose connections come from ``address`` (any 127/8 address reaches the gateway)."""
    return httpx.Client(base_url=service.url, transport=httpx.HTTPTransport(local_address=address), timeout=10)


def submit(client: httpx.Client, client_id: str, n: int) -> httpx.Response:
    return client.post("/v1/tasks", json={"input": f"rl-{n}"}, headers={"X-Client-Id": client_id})


def test_a_client_naming_another_clients_id_spends_only_its_own_bucket(service_factory: ServiceFactory) -> None:
    # Four workers: the few submits the attacker gets through never occupy every worker at once.
    service = service_factory(*RATE_FLAGS, workers=4)
    statuses: list[int] = []
    codes: set[str] = set()
    took_s = 0.0

    def attack() -> None:
        nonlocal took_s
        started = time.monotonic()
        with client_at(service, ATTACKER) as attacker:
            for n in range(ATTACK_SUBMITS):
                # the victim's id, and made-up ones that would each be a fresh bucket if trusted
                claimed = VICTIM_ID if n % 2 == 0 else f"fresh-{uuid.uuid4().hex[:8]}"
                response = submit(attacker, claimed, n)
                statuses.append(response.status_code)
                if response.status_code == 429:
                    codes.add(response.json()["error"]["code"])
                    assert "retry-after" in response.headers
                time.sleep(max(0.0, started + (n + 1) * ATTACK_PERIOD_S - time.monotonic()))  # pacing the attack
        took_s = time.monotonic() - started

    # The claim is about buckets: the normal client must get every answer, but its p99 over the ten or
    # so requests it can send under its own limit is one slow answer, not a latency figure.
    # No p99 is compared here (a few answers a second), so short windows: every answer is still checked.
    harm = unharmed(service, attack, rate_per_s=PROBE_RATE_PER_S, check_p99=False, baseline_s=1.0, min_during_s=2.5)

    accepted = statuses.count(202)
    most = BURST + math.ceil(RATE_PER_S * took_s) + 1
    assert accepted <= most, (
        f"the attacker has one bucket, its address's: at most {most} accepted in {took_s:.1f} s, got {accepted} "
        f"(each made-up id would have been a fresh bucket): {harm}"
    )
    assert statuses.count(429) == ATTACK_SUBMITS - accepted, f"the rest is 429: {sorted(set(statuses))}"
    assert codes == {"rate_limited"}, codes
    with client_at(service, VICTIM) as victim:
        answers = [submit(victim, VICTIM_ID, n).status_code for n in range(BURST)]
    assert answers == [202] * BURST, f"the victim's bucket is untouched by the attack: {answers}"


def test_behind_trust_client_id_the_header_is_the_client(embedded_service_factory: ServiceFactory) -> None:
    """The flag is what gives the header its meaning: with it, one id is one bucket whatever the address."""
    service = embedded_service_factory(
        "--rate-limit-per-s", "0.2", "--rate-limit-burst", "3", "--trust-client-id", "true"
    )
    with client_at(service, ATTACKER) as first, client_at(service, VICTIM) as second:
        drained = [submit(first, VICTIM_ID, n).status_code for n in range(4)]
        assert drained == [202, 202, 202, 429], drained
        assert submit(second, VICTIM_ID, 99).status_code == 429, "same id, same bucket, from any address"
        assert submit(second, "another-client", 100).status_code == 202, "another id is another bucket"
        malformed = second.post("/v1/tasks", json={"input": "x"}, headers={"X-Client-Id": "has space"})
        assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_client_id"
