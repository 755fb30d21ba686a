"""OpenAPI descriptions of our authentication classes (drf-spectacular extensions)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerKeyScheme(OpenApiAuthenticationExtension):
    target_class = "apps.core.authentication.BearerKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An operator key (sk-admin-…) or a tenant key (sk-tenant-…).",
        }


class AgentKeyScheme(OpenApiAuthenticationExtension):
    target_class = "apps.core.authentication.AgentKeyAuthentication"
    name = "agentKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
            "description": "The node agents' shared secret; accepted by agent endpoints only.",
        }


class SessionScheme(OpenApiAuthenticationExtension):
    target_class = "apps.core.authentication.PrincipalSessionAuthentication"
    name = "session"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "cookie", "name": "sessionid"}
