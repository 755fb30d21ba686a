from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "apps.core"
    label = "core"

    def ready(self):
        # Load the Celery app in every Django process so that `.delay()` from a view
        # goes to the configured broker rather than to Celery's default app.
        import celery_worker  # noqa: F401
        from apps.core import login_limits, schema  # noqa: F401  (sign-in lock-out signals; OpenAPI extensions for our auth)
