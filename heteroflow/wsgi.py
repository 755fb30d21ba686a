import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "heteroflow.settings")
application = get_wsgi_application()

from apps.monitoring import listener  # noqa: E402

listener.start_for_web()  # METRICS_LISTEN_ADDR, when set
