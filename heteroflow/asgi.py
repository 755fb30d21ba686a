import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "heteroflow.settings")
django_application = get_asgi_application()

from apps.core.asgi import BodyLimit  # noqa: E402  (needs Django set up)
from apps.gateway.api.route import GatewayApp  # noqa: E402
from apps.nodes.api.heartbeat import HeartbeatApp  # noqa: E402
from apps.tasks.api.create_route import TaskCreateApp  # noqa: E402
from apps.tasks.api.log_route import LogIngestApp  # noqa: E402
from apps.tunnel.api.app_proxy import AppProxy  # noqa: E402
from apps.tunnel.api.routes import TunnelRegisterApp, TunnelUserApp  # noqa: E402

# The OpenAI-compatible gateway (/v1/*), the heartbeat, the live log ingestion and the
# task create (with an API key) sit in front of Django as thin routes, each with its own
# body limit; everything else is Django's, behind the API's body limit. The tunnel's
# WebSockets (a user's way into a task), its agent registration and the interactive
# tasks' apps (/apps/{id}/) are thin routes too.
application = AppProxy(
    TunnelUserApp(
        GatewayApp(HeartbeatApp(LogIngestApp(TunnelRegisterApp(TaskCreateApp(BodyLimit(django_application))))))
    )
)

from apps.monitoring import listener  # noqa: E402

listener.start_for_web()  # METRICS_LISTEN_ADDR, when set

# What is loaded by now lives as long as the process: out of the collector's sight, a full
# collection walks only what requests leave behind. Without this, each full collection
# walked the ~140,000 objects of the loaded apps (60-140 ms with the process stopped):
# the heartbeat's and the gateway's tail latency.
gc.freeze()
