"""/metrics shows every tenant's traffic: with API keys on, only an operator key reads it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.edge.auth import digest_of
from tests.support.adversarial_rig import ServiceFactory

pytestmark = pytest.mark.slow

TENANT_KEY = "tenant-key-0123456789abcdef"
OTHER_TENANT_KEY = "other-tenant-0123456789abcdef"
OPERATOR_KEY = "operator-key-0123456789abcdef"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_key_cannot_read_deployment_wide_metrics(service_factory: ServiceFactory, tmp_path: Path) -> None:
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(
        f"# tenants\n{TENANT_KEY}\nsha256:{digest_of(OTHER_TENANT_KEY)}\n# monitoring\noperator {OPERATOR_KEY}\n"
    )
    service = service_factory("--api-keys-file", str(keys_file))
    with httpx.Client(base_url=service.url, timeout=10) as client:
        # the tenants' traffic, which the metrics would show
        for key in (TENANT_KEY, OTHER_TENANT_KEY):
            assert client.post("/v1/tasks", json={"input": "x"}, headers=bearer(key)).status_code == 202

        anonymous = client.get("/metrics")
        assert anonymous.status_code == 401, anonymous.text
        assert anonymous.json()["error"]["code"] == "unauthorized"
        for key in (TENANT_KEY, OTHER_TENANT_KEY):
            refused = client.get("/metrics", headers=bearer(key))
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["code"] == "forbidden", error
            assert "operator key" in error["message"], error
            assert "batchwire_" not in refused.text, "nothing of the metrics leaks into the refusal"
        for trick in ("/metrics/", "/metrics?x=1", "//metrics"):
            answer = client.get(trick, headers=bearer(TENANT_KEY))
            assert answer.status_code != 200, f"{trick}: {answer.status_code}"
            assert "batchwire_requests_total" not in answer.text, f"{trick} leaked the metrics"

        scraped = client.get("/metrics", headers=bearer(OPERATOR_KEY))
        assert scraped.status_code == 200, scraped.text
        assert "batchwire_requests_total" in scraped.text
        assert client.post("/v1/tasks", json={"input": "x"}, headers=bearer(OPERATOR_KEY)).status_code == 202, (
            "an operator key also works as an API key"
        )
        assert client.get("/healthz").status_code == 200, "the probes stay open"
    assert TENANT_KEY not in service.tail(200) and OPERATOR_KEY not in service.tail(200), "keys are never logged"


def test_without_api_keys_metrics_stay_open(embedded_service_factory: ServiceFactory) -> None:
    service = embedded_service_factory()
    assert service.host == "127.0.0.1", "without keys the gateway binds loopback by default"
    scraped = httpx.get(f"{service.url}/metrics", timeout=10)
    assert scraped.status_code == 200 and "batchwire_requests_total" in scraped.text
