import pytest

pytestmark = pytest.mark.django_db


def test_schema_is_served_and_names_our_security_schemes(client):
    response = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.")
    assert {"apiKey", "agentKey", "session"} <= set(schema["components"]["securitySchemes"])
    assert "/api/v1/tenants" in schema["paths"]


def test_docs_page_is_served_with_local_assets(client):
    response = client.get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "swagger-ui" in html and "/static/drf_spectacular_sidecar/" in html


def test_schema_generation_has_no_warnings():
    from django.core.management import call_command

    call_command("spectacular", "--fail-on-warn", "--validate", "--file", "/dev/null")
