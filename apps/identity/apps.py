from django.apps import AppConfig


class IdentityConfig(AppConfig):
    name = "apps.identity"
    label = "identity"

    def ready(self):
        from apps.identity import session  # noqa: F401  (connects the sign-in time's receiver)
