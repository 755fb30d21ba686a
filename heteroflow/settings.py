"""The one settings module. Every value comes from the environment (twelve-factor);
docs/configuration.md lists each variable with its default and range.

With no DATABASE_URL / REDIS_URL the launcher (`make up`, `make test`) starts an embedded
PostgreSQL and Redis and passes their URLs to every process it starts.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from heteroflow.envvars import Env
from heteroflow.rates import parse_rate
from heteroflow.safety import DEV_AGENT_SECRET, DEV_SECRET_KEY, production_problems

env = Env()
BASE_DIR = Path(__file__).resolve().parent.parent

HETEROFLOW_ENV = env.choice("HETEROFLOW_ENV", "development", ("development", "test", "production"))
PRODUCTION = HETEROFLOW_ENV == "production"

HETEROFLOW_PORT = env.int("HETEROFLOW_PORT", 3333, low=1, high=65535)
HETEROFLOW_DATA_DIR = Path(env.str("HETEROFLOW_DATA_DIR", str(BASE_DIR / ".heteroflow"))).resolve()

SECRET_KEY = env.str("SECRET_KEY", None if PRODUCTION else DEV_SECRET_KEY)
DEBUG = env.bool("DEBUG", HETEROFLOW_ENV == "development")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", [] if PRODUCTION else ["*"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", [])

# The agents' shared infrastructure secret (X-API-Key). Outside production a fixed
# development value keeps `make up` zero-setup; production refuses it.
HETEROFLOW_AGENT_SECRET = env.str("HETEROFLOW_AGENT_SECRET", None if PRODUCTION else DEV_AGENT_SECRET)

if PRODUCTION:
    _problems = production_problems(
        secret_key=SECRET_KEY,
        debug=DEBUG,
        allowed_hosts=ALLOWED_HOSTS,
        agent_secret=HETEROFLOW_AGENT_SECRET,
    )
    if _problems:
        raise ImproperlyConfigured("HeteroFlow refuses to start in production mode: " + "; ".join(_problems) + ".")

# --- applications -------------------------------------------------------------------
# django-tenants splits the apps: SHARED_APPS live in `public` (what the cluster sees
# across tenants), TENANT_APPS in each tenant's own schema (what is confidential to it).
SHARED_APPS = [
    "django_tenants",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "servestatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_prometheus",
    "apps.core",
    "apps.tenants",
    "apps.nodes",
    "apps.tasks",
    "apps.alerts",
    "apps.scheduler",
    "apps.inference",
    "apps.slices",
    "apps.gateway",
    "apps.tunnel",
    "apps.monitoring",
    "apps.portal",
    "apps.identity",
]
TENANT_APPS = [
    "apps.confidential",
]
INSTALLED_APPS = SHARED_APPS + [app for app in TENANT_APPS if app not in SHARED_APPS]

TENANT_MODEL = "tenants.Tenant"
TENANT_DOMAIN_MODEL = "tenants.Domain"
PUBLIC_SCHEMA_NAME = "public"
DATABASE_ROUTERS = ("django_tenants.routers.TenantSyncRouter",)
# Issue `SET search_path` only when the schema changes, not before every query (it was
# a third of the statements of a node-list page).
TENANT_LIMIT_SET_CALLS = True

# No TenantMainMiddleware: the tenant comes from the principal, not from the host name,
# so every request starts in `public` and switches schema explicitly when it must.
MIDDLEWARE = [
    "apps.monitoring.middleware.HealthProbeMiddleware",
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "apps.core.middleware.SecurityHeadersMiddleware",
    "servestatic.middleware.ServeStaticMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # every change a person makes is in the audit log (docs/security.md#audit-log)
    "apps.confidential.middleware.AuditMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "heteroflow.urls"
ASGI_APPLICATION = "heteroflow.asgi.application"
WSGI_APPLICATION = "heteroflow.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "apps.portal.context.portal",
            ],
        },
    },
]

# --- data stores ----------------------------------------------------------------------
DATABASE_URL = env.str("DATABASE_URL")
if not DATABASE_URL:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set. Start the system with `make up` (which runs an embedded "
        "PostgreSQL when no URL is given) or set DATABASE_URL=postgresql://USER@HOST:PORT/DB."
    )
DB_CONNECT_TIMEOUT = env.int("HETEROFLOW_DB_CONNECT_TIMEOUT", 5, low=1, high=60)
# Under ASGI every request runs its sync code in a thread of its own, so per-thread
# persistent connections are never reused: without a pool each request would connect
# anew (~10 ms). Django's psycopg pool hands connections across threads.
DB_POOL_SIZE = env.int("HETEROFLOW_DB_POOL_SIZE", 10, low=0, high=200)
DATABASES = {"default": dj_database_url.parse(DATABASE_URL)}
DATABASES["default"]["ENGINE"] = "django_tenants.postgresql_backend"
# django-tenants builds on this backend: django-prometheus's, which counts connections,
# statements, their duration and errors (django_db_* in /metrics).
ORIGINAL_BACKEND = "django_prometheus.db.backends.postgresql"
DATABASES["default"].setdefault("OPTIONS", {})["connect_timeout"] = DB_CONNECT_TIMEOUT
if DB_POOL_SIZE:
    DATABASES["default"]["OPTIONS"]["pool"] = {"min_size": 1, "max_size": DB_POOL_SIZE, "timeout": 10}
    # With the pool, Django's health checks are the pool's `check`: a pooled connection is
    # tried (an empty query, one round trip) before it is handed out, so that after the
    # database restarted or terminated the connections no request gets a dead one and
    # fails (tests/faults/test_database_loss.py).
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
else:
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("HETEROFLOW_DB_CONN_MAX_AGE", 60, low=0, high=3600)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

REDIS_URL = env.str("REDIS_URL")
if not REDIS_URL:
    raise ImproperlyConfigured(
        "REDIS_URL is not set. Start the system with `make up` (which runs an embedded Redis "
        "when no URL is given) or set REDIS_URL=redis://HOST:6379/0."
    )


def _celery_url(redis_url: str) -> str:
    # redis-py spells a Unix socket unix://PATH?db=N; kombu spells it
    # redis+socket://PATH?virtual_host=N.
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url.removeprefix("unix://").replace("?db=", "?virtual_host=")
    return redis_url


CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "hf",
    }
}

# --- Celery ---------------------------------------------------------------------------
CELERY_BROKER_URL = _celery_url(REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"

# --- auth -----------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
if HETEROFLOW_ENV == "test":
    # Hashing cost is not what the tests are about.
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# The sign-in lock-out (apps.core.login_limits) goes first: while it holds, no password
# is checked by the backends after it.
AUTHENTICATION_BACKENDS = [
    "apps.core.login_limits.LockoutBackend",
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_URL = "/portal/login/"
LOGIN_REDIRECT_URL = "/portal/"
LOGOUT_REDIRECT_URL = "/portal/login/"

# --- i18n / static --------------------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = HETEROFLOW_DATA_DIR / "static"
# servestatic (whitenoise's maintained fork, async-native, so it adds no thread hop per
# request under ASGI). Outside production it serves straight from the app folders, so
# `make up` needs no collectstatic step; production images run collectstatic at build.
SERVESTATIC_USE_FINDERS = not PRODUCTION
SERVESTATIC_AUTOREFRESH = DEBUG
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- API ------------------------------------------------------------------------------
REST_FRAMEWORK = {
    # Bearer first: its WWW-Authenticate header is what turns "no credentials" into 401.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.core.authentication.BearerKeyAuthentication",
        "apps.core.authentication.AgentKeyAuthentication",
        "apps.core.authentication.PrincipalSessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["apps.core.permissions.IsPersonOrPersonKey"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["apps.core.renderers.FastJSONRenderer"],
    "DEFAULT_PAGINATION_CLASS": "apps.core.pagination.Pagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "apps.core.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
    # per key / person, and per node for the agent key (apps.core.throttling)
    "DEFAULT_THROTTLE_CLASSES": ["apps.core.throttling.PrincipalRateThrottle"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "HeteroFlow control plane API",
    "DESCRIPTION": "One schedulable resource out of a mixed GPU fleet.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # The schema and its page are public documentation; they expose no data.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    # every operation documents the error answers (apps.core.openapi), after the enums
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "apps.core.openapi.add_error_responses",
    ],
    "ENUM_NAME_OVERRIDES": {
        "NodeStatusEnum": "apps.nodes.choices.NodeStatus",
        "SimulationStateEnum": "apps.scheduler.models.Simulation.State",
        "TaskStatusEnum": "apps.tasks.choices.TaskStatus",
        "GpuStateEnum": "apps.nodes.choices.GpuState",
        "AlertScopeEnum": "apps.alerts.choices.AlertScope",
        "AlertTypeEnum": "apps.alerts.choices.AlertType",
        "SeverityEnum": "apps.alerts.choices.Severity",
        "KeyScopeEnum": "apps.tenants.choices.KeyScope",
        "TaskKindEnum": "apps.tasks.choices.TaskKind",
        "ChannelKindEnum": "apps.alerts.choices.ChannelKind",
        "DeliveryStatusEnum": "apps.alerts.choices.DeliveryStatus",
        "TaskGroupStatusEnum": "apps.tasks.choices.GroupStatus",
        "TaskGroupKindEnum": "apps.tasks.choices.GroupKind",
        "InferenceServiceStateEnum": "apps.inference.choices.ServiceStatus",
        "ImageRequestStatusEnum": "apps.nodes.choices.ImageRequestStatus",
        "HealthProbeTypeEnum": [("http", "http"), ("tcp", "tcp")],
        "SliceStateEnum": "apps.slices.choices.SliceState",
    },
}

# --- gateway (/v1/*, apps.gateway) ---------------------------------------------------------
# A rotated endpoint key's old secret keeps working this long (unless the rotation says).
HETEROFLOW_GATEWAY_ROTATE_GRACE_SECONDS = env.int(
    "HETEROFLOW_GATEWAY_ROTATE_GRACE_SECONDS", 86_400, low=0, high=30 * 86_400
)
# Keys, routes and backends are cached in each process: a change made through the
# services is seen at once in the process that made it and within CHECK seconds in the
# others (a version counter in Redis); backends (replica health) are read again every
# BACKENDS seconds.
HETEROFLOW_GATEWAY_CACHE_CHECK_SECONDS = env.float("HETEROFLOW_GATEWAY_CACHE_CHECK_SECONDS", 1.0, low=0.0, high=60.0)
HETEROFLOW_GATEWAY_KEYS_TTL_SECONDS = env.float("HETEROFLOW_GATEWAY_KEYS_TTL_SECONDS", 30.0, low=0.0, high=3_600.0)
HETEROFLOW_GATEWAY_BACKENDS_TTL_SECONDS = env.float("HETEROFLOW_GATEWAY_BACKENDS_TTL_SECONDS", 2.0, low=0.0, high=60.0)
# A backend that refused a connection is out of rotation this long in that process.
HETEROFLOW_GATEWAY_QUARANTINE_SECONDS = env.float("HETEROFLOW_GATEWAY_QUARANTINE_SECONDS", 10.0, low=0.0, high=600.0)
# The API's bodies (everything Django serves under /api/): larger ones are refused with
# 413 before they are read (apps.core.asgi.BodyLimit). The heartbeat and the gateway have
# their own limits.
HETEROFLOW_API_MAX_BODY_BYTES = env.int("HETEROFLOW_API_MAX_BODY_BYTES", 2_621_440, low=65_536, high=268_435_456)
HETEROFLOW_GATEWAY_MAX_BODY_BYTES = env.int(
    "HETEROFLOW_GATEWAY_MAX_BODY_BYTES", 16_777_216, low=65_536, high=268_435_456
)
HETEROFLOW_GATEWAY_CONNECT_TIMEOUT_SECONDS = env.float(
    "HETEROFLOW_GATEWAY_CONNECT_TIMEOUT_SECONDS", 5.0, low=0.1, high=120.0
)
# Until the backend's first byte (a long prompt's prefill), then between two chunks.
HETEROFLOW_GATEWAY_FIRST_BYTE_TIMEOUT_SECONDS = env.float(
    "HETEROFLOW_GATEWAY_FIRST_BYTE_TIMEOUT_SECONDS", 300.0, low=1.0, high=3_600.0
)
HETEROFLOW_GATEWAY_IDLE_TIMEOUT_SECONDS = env.float(
    "HETEROFLOW_GATEWAY_IDLE_TIMEOUT_SECONDS", 120.0, low=1.0, high=3_600.0
)
HETEROFLOW_GATEWAY_MAX_CONNECTIONS = env.int("HETEROFLOW_GATEWAY_MAX_CONNECTIONS", 1_000, low=1, high=100_000)
HETEROFLOW_GATEWAY_DB_POOL_SIZE = env.int("HETEROFLOW_GATEWAY_DB_POOL_SIZE", 4, low=1, high=100)
HETEROFLOW_GATEWAY_BALANCER = env.choice(
    "HETEROFLOW_GATEWAY_BALANCER", "least_connections", ("round_robin", "random", "least_connections")
)
HETEROFLOW_GATEWAY_STICKINESS = env.bool("HETEROFLOW_GATEWAY_STICKINESS", True)
# A request for a sleeping service asks for its wake and waits this long for a healthy
# replica; 0: answers 503 with Retry-After at once.
HETEROFLOW_GATEWAY_WAKE_WAIT_SECONDS = env.float("HETEROFLOW_GATEWAY_WAKE_WAIT_SECONDS", 0.0, low=0.0, high=600.0)
HETEROFLOW_GATEWAY_WAKE_RETRY_AFTER_SECONDS = env.int(
    "HETEROFLOW_GATEWAY_WAKE_RETRY_AFTER_SECONDS", 30, low=1, high=3_600
)
# A request that never said it ended (a process killed mid-request) stops counting
# towards a concurrency limit after this long.
HETEROFLOW_GATEWAY_CONCURRENCY_TTL_SECONDS = env.int(
    "HETEROFLOW_GATEWAY_CONCURRENCY_TTL_SECONDS", 900, low=10, high=86_400
)
# Where an operator-declared external backend may point: host names, `.domain` for a
# domain and its sub-domains, networks (CIDR) for literal addresses. Empty: none allowed.
HETEROFLOW_GATEWAY_EXTERNAL_ALLOWED = env.list("HETEROFLOW_GATEWAY_EXTERNAL_ALLOWED", [])
# last_request_at, last_used_at and usage rows are written this often per process (and at
# shutdown): what a SIGKILL loses is at most this long's worth.
HETEROFLOW_GATEWAY_FLUSH_SECONDS = env.float("HETEROFLOW_GATEWAY_FLUSH_SECONDS", 2.0, low=0.1, high=600.0)
# The largest limits an endpoint key may have, platform-wide (0: no maximum). A key set
# above one is refused (400); a key with no limit of its own, or one set above it before
# the maximum was lowered, is held to it.
HETEROFLOW_GATEWAY_KEY_MAX_RPM = env.int("HETEROFLOW_GATEWAY_KEY_MAX_RPM", 0, low=0, high=10_000_000) or None
HETEROFLOW_GATEWAY_KEY_MAX_TPM = env.int("HETEROFLOW_GATEWAY_KEY_MAX_TPM", 0, low=0, high=10_000_000_000) or None
HETEROFLOW_GATEWAY_KEY_MAX_CONCURRENCY = (
    env.int("HETEROFLOW_GATEWAY_KEY_MAX_CONCURRENCY", 0, low=0, high=100_000) or None
)
# While Redis is away: `local` (each process enforces its share of every limit, the limit
# divided by the gateway processes it last counted), `closed` (503) or `open` (no limits).
HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS = env.choice(
    "HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS", "local", ("local", "closed", "open")
)

# --- nodes ----------------------------------------------------------------------------
HETEROFLOW_HEARTBEAT_MAX_BYTES = env.int("HETEROFLOW_HEARTBEAT_MAX_BYTES", 262_144, low=4_096, high=8_388_608)
HETEROFLOW_HEARTBEAT_DB_POOL_SIZE = env.int("HETEROFLOW_HEARTBEAT_DB_POOL_SIZE", 8, low=1, high=100)
# `off`: a beat's commit does not wait for its WAL to be flushed (docs/nodes.md); `on`: it does.
HETEROFLOW_HEARTBEAT_SYNCHRONOUS_COMMIT = env.choice("HETEROFLOW_HEARTBEAT_SYNCHRONOUS_COMMIT", "off", ("off", "on"))
# Proxies whose X-Forwarded-For is believed when they are the TCP peer (CIDRs). Empty:
# the node's public IP is always the TCP source address (uvicorn runs with
# --no-proxy-headers everywhere we start it, so it does not rewrite the peer itself).
HETEROFLOW_TRUSTED_PROXIES = env.cidr_list("HETEROFLOW_TRUSTED_PROXIES", [])
# The CPU power estimate (never measured): TDP × (idle + (1 − idle) × cpu_used / 100),
# with this share of the TDP drawn by an idle CPU (apps.nodes.energy).
HETEROFLOW_CPU_IDLE_POWER_FRACTION = env.float("HETEROFLOW_CPU_IDLE_POWER_FRACTION", 0.3, low=0.0, high=1.0)
HETEROFLOW_TASK_TIMEOUT_SECONDS = env.int("HETEROFLOW_TASK_TIMEOUT_SECONDS", 7_200, low=60, high=31 * 86_400)
# Interactive tasks (docs/interactive.md): how long one may sit idle (its cards under the
# utilisation, no tunnel session) before it is stopped, by default and at most (a tenant
# may set its own of both); its owner is warned this many minutes before; how long one
# runs at most when it names no max_hours; the image each vendor's nodes start one in
# when it names none (`nvidia=IMAGE,default=IMAGE`); how often the job looks.
HETEROFLOW_INTERACTIVE_IDLE_MINUTES = env.int("HETEROFLOW_INTERACTIVE_IDLE_MINUTES", 60, low=1, high=44_640)
HETEROFLOW_INTERACTIVE_IDLE_MINUTES_MAX = env.int("HETEROFLOW_INTERACTIVE_IDLE_MINUTES_MAX", 1_440, low=1, high=44_640)
HETEROFLOW_INTERACTIVE_IDLE_PERCENT = env.float("HETEROFLOW_INTERACTIVE_IDLE_PERCENT", 5.0, low=0.0, high=100.0)
HETEROFLOW_INTERACTIVE_WARN_MINUTES = env.int("HETEROFLOW_INTERACTIVE_WARN_MINUTES", 10, low=0, high=1_440)
HETEROFLOW_INTERACTIVE_MAX_HOURS = env.float("HETEROFLOW_INTERACTIVE_MAX_HOURS", 12.0, low=0.1, high=744.0)
HETEROFLOW_INTERACTIVE_IMAGES = env.mapping("HETEROFLOW_INTERACTIVE_IMAGES", {})
# The host (host:port) interactive tasks' apps are served on in the browser, never the
# control plane's own (docs/interactive.md#in-the-browser); `{id}` stands for the task's id
# (a wildcard DNS name gives each app an origin of its own). "": the portal's Open is off.
HETEROFLOW_APP_HOST = env.str("HETEROFLOW_APP_HOST", "")
# how often an app's cookie (/apps/{id}/, docs/interactive.md#in-the-browser) has its person
# and task admitted again
HETEROFLOW_APP_RECHECK_SECONDS = env.int("HETEROFLOW_APP_RECHECK_SECONDS", 300, low=1, high=86_400)
HETEROFLOW_INTERACTIVE_RECLAIM_SECONDS = env.float(
    "HETEROFLOW_INTERACTIVE_RECLAIM_SECONDS", 60.0, low=1.0, high=3_600.0
)
# Submitting: the most tasks one POST /api/v1/tasks/batch creates, and how often creates
# ask the scheduler for a cycle at most (one cycle now and one at the interval's end,
# however many tasks are created meanwhile; 0: one per create, as the tests run).
HETEROFLOW_TASK_BATCH_MAX = env.int("HETEROFLOW_TASK_BATCH_MAX", 10_000, low=1, high=100_000)
HETEROFLOW_SUBMIT_TICK_SECONDS = env.float(
    "HETEROFLOW_SUBMIT_TICK_SECONDS", 0.0 if HETEROFLOW_ENV == "test" else 1.0, low=0.0, high=5.0
)
METRICS_RETENTION_HOURS = env.int("METRICS_RETENTION_HOURS", 168, low=1, high=8_760)
# How long finished image requests (docs/images.md) are kept before the janitor deletes them.
HETEROFLOW_IMAGE_REQUEST_RETENTION_DAYS = env.int("HETEROFLOW_IMAGE_REQUEST_RETENTION_DAYS", 7, low=1, high=365)
# Live task logs (docs/tasks.md#logs): the lines kept per task (the oldest trimmed past
# it), how many days they are kept (partitions dropped whole), the ingestion route's
# connections (apart from the heartbeat's), and the largest compressed batch it takes.
HETEROFLOW_TASK_LOG_MAX_BYTES = env.int("HETEROFLOW_TASK_LOG_MAX_BYTES", 16 * 1024 * 1024, low=65_536, high=1 << 34)
HETEROFLOW_TASK_LOG_RETENTION_DAYS = env.int("HETEROFLOW_TASK_LOG_RETENTION_DAYS", 7, low=1, high=365)
HETEROFLOW_TASK_LOG_DB_POOL_SIZE = env.int("HETEROFLOW_TASK_LOG_DB_POOL_SIZE", 4, low=1, high=100)
# how often a follower reads the table when Redis brings nothing (Redis away, a lost message)
HETEROFLOW_LOG_FOLLOW_POLL_SECONDS = env.float("HETEROFLOW_LOG_FOLLOW_POLL_SECONDS", 5.0, low=0.1, high=60.0)
HETEROFLOW_TASK_LOG_MAX_BODY_BYTES = env.int(
    "HETEROFLOW_TASK_LOG_MAX_BODY_BYTES", 8 * 1024 * 1024, low=65_536, high=1 << 30
)
# How long one scheduler process reuses the GPU rows it read (their live readings are
# refreshed by heartbeats every 5 s anyway); node rows and the GPU ledger are read fresh
# every cycle, and bind re-checks the chosen cards. 0: read everything every cycle.
HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS = env.float(
    "HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS", 0.0 if HETEROFLOW_ENV == "test" else 5.0, low=0.0, high=60.0
)
# The most inference replicas one node runs at once (spec 004, "推理容器上限"): a node at
# the cap takes no further replica; other tasks never meet it. 0: no cap (the host-port
# pool, 1,000 ports, still bounds a node).
HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE = env.int("HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE", 8, low=0, high=1_000)
# Training borrows idle inference cards (spec 004, "训练借卡"): the most replicas of one
# service lent at once to training tasks. 0: nothing is lent.
HETEROFLOW_INFERENCE_LEND_MAX_REPLICAS = env.int("HETEROFLOW_INFERENCE_LEND_MAX_REPLICAS", 4, low=0, high=1_000)
# Task groups: the most workers one group may ask for (POST /api/v1/task-groups,
# world_size); more is 400. Its members are created in one transaction.
HETEROFLOW_GROUP_MAX_WORLD_SIZE = env.int("HETEROFLOW_GROUP_MAX_WORLD_SIZE", 1_024, low=1, high=65_536)
# Task groups: how the scheduler decides that a group's nodes share one private network
# (apps/nodes/network.py). "prove": only explicit, agreeing labels count; "assume_same":
# one VPC is assumed unless a difference is proven (docs/scheduler.md#task-groups).
HETEROFLOW_NETWORK_DOMAIN_POLICY = env.choice(
    "HETEROFLOW_NETWORK_DOMAIN_POLICY", "prove", ("prove", "labels", "assume_same")
)
# Task groups: how long a group waits at the head of its priority before it holds the
# cards it needs as they free up, against smaller work of its priority or lower
# (docs/scheduler.md#no-starvation-the-reservation). 0: at once.
# The host ports a node hands out (an inference replica serves on one, a training group's
# master listens on one): the first and the last of the block, the same on every node.
HETEROFLOW_HOST_PORT_FIRST = env.int("HETEROFLOW_HOST_PORT_FIRST", 8000, low=1024, high=65535)
HETEROFLOW_HOST_PORT_LAST = env.int("HETEROFLOW_HOST_PORT_LAST", 8999, low=HETEROFLOW_HOST_PORT_FIRST, high=65535)
HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = env.int("HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS", 300, low=0, high=86_400)
# How often the start-time estimates of the waiting work are computed again
# (apps.scheduler.predictions, docs/predictions.md).
HETEROFLOW_PREDICT_INTERVAL_SECONDS = env.int("HETEROFLOW_PREDICT_INTERVAL_SECONDS", 30, low=5, high=3600)
# Queues (docs/queues.md): the half-life of the usage above nominal that orders borrowers.
HETEROFLOW_FAIR_SHARE_HALF_LIFE_DAYS = env.float("HETEROFLOW_FAIR_SHARE_HALF_LIFE_DAYS", 7.0, low=0.01, high=365.0)
# --- node liveness (apps/nodes/liveness.py, docs/nodes.md#node-status) ------------------
# The node list's status: suspect after this much silence, offline after that much.
HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS = env.int("HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS", 30, low=10, high=3_600)
HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS = env.int("HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS", 60, low=15, high=7_200)
if HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS >= HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS:
    raise ImproperlyConfigured(
        f"HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS ({HETEROFLOW_NODE_STATUS_SUSPECT_SECONDS}) must be less than "
        f"HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS ({HETEROFLOW_NODE_STATUS_OFFLINE_SECONDS})"
    )
# Memory drift (apps.nodes.drift, every 10 s): a card whose measured memory use exceeds
# what the GPU ledger explains by more than this many MB, for this many of its node's
# heartbeat intervals, raises GPU_MEMORY_DRIFT.
HETEROFLOW_GPU_MEMORY_DRIFT_MB = env.int("HETEROFLOW_GPU_MEMORY_DRIFT_MB", 2048, low=0, high=1_048_576)
HETEROFLOW_GPU_MEMORY_DRIFT_BEATS = env.int("HETEROFLOW_GPU_MEMORY_DRIFT_BEATS", 3, low=1, high=1000)
# --- failure handling (docs/failures.md) -----------------------------------------------
# A node silent this long is given up by the failure policy: NODE_OFFLINE, tasks
# requeued, nothing more placed on it (whatever its status still shows).
HETEROFLOW_NODE_OFFLINE_SECONDS = env.int("HETEROFLOW_NODE_OFFLINE_SECONDS", 45, low=10, high=3_600)
# How often the alert sweep runs (beat's period and its guard's).
HETEROFLOW_ALERT_SWEEP_SECONDS = env.int("HETEROFLOW_ALERT_SWEEP_SECONDS", 30, low=5, high=600)
# Notification storms (apps.alerts.notifications.dispatch): per channel, at most this many
# alerts one by one in a dispatch run (every 10 s) and this many deliveries a minute; the
# rest go out as one digest per run, listing the first HETEROFLOW_NOTIFY_DIGEST_LISTED.
HETEROFLOW_NOTIFY_GROUP_AFTER = env.int("HETEROFLOW_NOTIFY_GROUP_AFTER", 5, low=0, high=1000)
HETEROFLOW_NOTIFY_PER_MINUTE = env.int("HETEROFLOW_NOTIFY_PER_MINUTE", 30, low=1, high=10_000)
HETEROFLOW_NOTIFY_DIGEST_LISTED = env.int("HETEROFLOW_NOTIFY_DIGEST_LISTED", 50, low=1, high=1000)
# Retention (alerts.prune, hourly): ended alerts and finished deliveries older than this
# many days are deleted.
HETEROFLOW_ALERT_RETENTION_DAYS = env.int("HETEROFLOW_ALERT_RETENTION_DAYS", 90, low=1, high=3650)
HETEROFLOW_DELIVERY_RETENTION_DAYS = env.int("HETEROFLOW_DELIVERY_RETENTION_DAYS", 30, low=1, high=3650)
# --- card health (docs/gpu-health.md) ---------------------------------------------------
# The Xid codes that cordon a card when a new one appears in its readings. The defaults,
# from NVIDIA's Xid catalogue: 48 double-bit ECC error; 62 internal micro-controller
# halt; 64 ECC page retirement or row-remapping recording failure; 74 NVLink error; 79
# the GPU has fallen off the bus; 92 high single-bit ECC error rate; 94 contained ECC
# error; 95 uncontained ECC error; 119 GSP RPC timeout; 120 GSP error.
HETEROFLOW_GPU_FATAL_XIDS = env.list(
    "HETEROFLOW_GPU_FATAL_XIDS", ["48", "62", "64", "74", "79", "92", "94", "95", "119", "120"]
)
try:
    HETEROFLOW_GPU_FATAL_XIDS = sorted({int(code) for code in HETEROFLOW_GPU_FATAL_XIDS})
except ValueError:
    raise ImproperlyConfigured(
        f"HETEROFLOW_GPU_FATAL_XIDS must be whole numbers separated by commas, not {HETEROFLOW_GPU_FATAL_XIDS!r}"
    ) from None
# A card the health judgement cordoned is uncordoned by itself after this many hours
# without bad evidence while it kept reporting. 0: only an operator uncordons.
HETEROFLOW_GPU_HEALTH_CLEAN_HOURS = env.int("HETEROFLOW_GPU_HEALTH_CLEAN_HOURS", 0, low=0, high=24 * 365)
# Failure prediction shows a model's figure only when at least this many of its cards
# were seen with corrected ECC errors; fewer: "not enough data", never a percentage.
HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS = env.int(
    "HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS", 30, low=1, high=1_000_000
)
# A running task its live node has not listed as alive for this long is stalled.
HETEROFLOW_STALLED_TASK_SECONDS = env.int("HETEROFLOW_STALLED_TASK_SECONDS", 60, low=15, high=3_600)
# A task still queued this long after it was created or last changed (the later of the
# two) fails. 0: tasks wait as long as it takes.
HETEROFLOW_QUEUE_TIMEOUT_SECONDS = env.int("HETEROFLOW_QUEUE_TIMEOUT_SECONDS", 86_400, low=0, high=90 * 86_400)
# A task group whose attempt ends on a lost worker is requeued whole this many times in
# all (placements, counting the first); the loss that ends the last one fails it whole.
HETEROFLOW_GROUP_MAX_ATTEMPTS = env.int("HETEROFLOW_GROUP_MAX_ATTEMPTS", 3, low=1, high=100)
# No scheduler cycle finished for this long while tasks wait: SCHEDULER_STALLED.
HETEROFLOW_SCHEDULER_STALLED_SECONDS = env.int("HETEROFLOW_SCHEDULER_STALLED_SECONDS", 60, low=15, high=3_600)
# Agent installation (docs/agent-install.md). `manage.py build_agent_dist` puts the agent
# wheel and its dependency wheels for each architecture here, and the install endpoints
# serve them from here. HETEROFLOW_PUBLIC_URL is the URL nodes reach this control plane
# at (e.g. https://hf.example.com); empty: the URL the install script was fetched from.
HETEROFLOW_AGENT_DIST_DIR = Path(
    env.str("HETEROFLOW_AGENT_DIST_DIR", str(HETEROFLOW_DATA_DIR / "agent-dist"))
).resolve()
HETEROFLOW_PUBLIC_URL = (env.str("HETEROFLOW_PUBLIC_URL", "") or "").rstrip("/")
if HETEROFLOW_PUBLIC_URL:
    from urllib.parse import urlsplit as _urlsplit

    _public = _urlsplit(HETEROFLOW_PUBLIC_URL)
    if (
        _public.scheme not in ("http", "https")
        or not _public.netloc
        or _public.query
        or _public.fragment
        or any(c in HETEROFLOW_PUBLIC_URL for c in "'\"\\ `$")
    ):
        raise ImproperlyConfigured(
            f"HETEROFLOW_PUBLIC_URL={HETEROFLOW_PUBLIC_URL!r} is not an http(s) URL like https://hf.example.com"
        )

# --- alert notifications (docs/alerts.md#notification-channels) ---------------------
# One webhook attempt: connect and read time-outs, each.
HETEROFLOW_NOTIFY_TIMEOUT_SECONDS = env.float("HETEROFLOW_NOTIFY_TIMEOUT_SECONDS", 5.0, low=0.1, high=60.0)
# Attempts per delivery (the first one included) before it fails permanently.
HETEROFLOW_NOTIFY_MAX_ATTEMPTS = env.int("HETEROFLOW_NOTIFY_MAX_ATTEMPTS", 8, low=1, high=20)
# Back-off after failed attempt n: BACKOFF * 2**(n-1) seconds, at most BACKOFF_MAX (also
# the cap on a receiver's Retry-After).
HETEROFLOW_NOTIFY_BACKOFF_SECONDS = env.float("HETEROFLOW_NOTIFY_BACKOFF_SECONDS", 10.0, low=0.1, high=3600.0)
HETEROFLOW_NOTIFY_BACKOFF_MAX_SECONDS = env.float(
    "HETEROFLOW_NOTIFY_BACKOFF_MAX_SECONDS", 900.0, low=1.0, high=86_400.0
)
# Whether tenants' webhooks may reach loopback, private, link-local and other
# non-public addresses (the control plane's own network). Operators' webhooks always may.
HETEROFLOW_NOTIFY_ALLOW_PRIVATE_TARGETS = env.bool("HETEROFLOW_NOTIFY_ALLOW_PRIVATE_TARGETS", not PRODUCTION)

# E-mail (Django's mail backend): notification channels of kind "email".
EMAIL_BACKENDS = {
    "smtp": "django.core.mail.backends.smtp.EmailBackend",
    "console": "django.core.mail.backends.console.EmailBackend",
    "dummy": "django.core.mail.backends.dummy.EmailBackend",
}
EMAIL_BACKEND = EMAIL_BACKENDS[
    env.choice("HETEROFLOW_EMAIL_BACKEND", "smtp" if PRODUCTION else "console", tuple(EMAIL_BACKENDS))
]
EMAIL_HOST = env.str("EMAIL_HOST", "localhost")
EMAIL_PORT = env.int("EMAIL_PORT", 25, low=1, high=65535)
EMAIL_HOST_USER = env.str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env.str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env.bool("EMAIL_USE_SSL", False)
if EMAIL_USE_TLS and EMAIL_USE_SSL:
    raise ImproperlyConfigured(
        "EMAIL_USE_TLS and EMAIL_USE_SSL cannot both be true (STARTTLS or implicit TLS: pick one)"
    )
EMAIL_TIMEOUT = env.float("EMAIL_TIMEOUT", 10.0, low=1.0, high=120.0)
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", "HeteroFlow <heteroflow@localhost>")
EMAIL_SUBJECT_PREFIX = "[HeteroFlow] "

# --- monitoring (docs/monitoring.md) --------------------------------------------------
# Control-plane host samples (server_metrics); METRICS_RETENTION_HOURS above is the
# nodes' own metrics.
HETEROFLOW_SERVER_METRICS_RETENTION_HOURS = env.int("HETEROFLOW_SERVER_METRICS_RETENTION_HOURS", 168, low=1, high=8_760)
# The name this host's samples are kept under; empty: the machine's host name.
HETEROFLOW_SERVER_METRICS_HOST = env.str("HETEROFLOW_SERVER_METRICS_HOST", "")
# /metrics answers loopback, RFC 1918 and CGNAT peers only, unless this is true.
HETEROFLOW_METRICS_ALLOW_PUBLIC = env.bool("HETEROFLOW_METRICS_ALLOW_PUBLIC", False)
# A separate listener of the web process (/metrics, /healthz, /readyz), and the exporters
# of the Celery worker and beat processes. Unset: none.
METRICS_LISTEN_ADDR = env.address("METRICS_LISTEN_ADDR")
HETEROFLOW_WORKER_METRICS_ADDR = env.address("HETEROFLOW_WORKER_METRICS_ADDR")
HETEROFLOW_BEAT_METRICS_ADDR = env.address("HETEROFLOW_BEAT_METRICS_ADDR")
# prometheus_client reads this variable itself, before any metric exists; it must name an
# existing folder of this process group's own (docs/monitoring.md#several-processes).
PROMETHEUS_MULTIPROC_DIR = env.str("PROMETHEUS_MULTIPROC_DIR")
if PROMETHEUS_MULTIPROC_DIR and not Path(PROMETHEUS_MULTIPROC_DIR).is_dir():
    raise ImproperlyConfigured(
        f"PROMETHEUS_MULTIPROC_DIR={PROMETHEUS_MULTIPROC_DIR!r} is not a folder; create it (empty) before starting"
    )

# --- bootstrap ------------------------------------------------------------------------
HETEROFLOW_ADMIN_USER = env.str("HETEROFLOW_ADMIN_USER", "admin")
HETEROFLOW_ADMIN_EMAIL = env.str("HETEROFLOW_ADMIN_EMAIL", "admin@localhost")
HETEROFLOW_ADMIN_PASSWORD = env.str("HETEROFLOW_ADMIN_PASSWORD")
HETEROFLOW_ADMIN_API_KEY = env.str("HETEROFLOW_ADMIN_API_KEY")

# --- rate limits (docs/security.md#rate-limits) ------------------------------------------
# API requests per key (or per signed-in person): N/s, N/min, N/h, N/10s; "off": none.
# 6000/min is 100/s sustained per key, above what one tenant's creates can reach (the
# per-tenant row lock caps them near 250/s, for at most a few seconds of a sweep: use
# the batch form for more).
HETEROFLOW_API_RATE = parse_rate("HETEROFLOW_API_RATE", env.str("HETEROFLOW_API_RATE", "6000/min"))
# Agent-key requests that name a node, per node id: the task poll every 5 s, and a stop
# check every 5 s for each task the node runs (12 a minute each), so 3000/min leaves
# room for some 240 tasks on one node (slices, replicas) and still stops a runaway loop.
# The heartbeat is never counted.
HETEROFLOW_API_RATE_AGENT_NODE = parse_rate(
    "HETEROFLOW_API_RATE_AGENT_NODE", env.str("HETEROFLOW_API_RATE_AGENT_NODE", "3000/min")
)
# Sign-in: the MAX_FAILURES-th failure of one username from one address within WINDOW
# locks it out for LOCKOUT seconds, doubled for each lock-out in a row.
HETEROFLOW_LOGIN_MAX_FAILURES = env.int("HETEROFLOW_LOGIN_MAX_FAILURES", 5, low=1, high=1_000)
HETEROFLOW_LOGIN_FAILURE_WINDOW_SECONDS = env.int("HETEROFLOW_LOGIN_FAILURE_WINDOW_SECONDS", 900, low=10, high=86_400)
HETEROFLOW_LOGIN_LOCKOUT_SECONDS = env.int("HETEROFLOW_LOGIN_LOCKOUT_SECONDS", 300, low=1, high=86_400)

# --- security headers -----------------------------------------------------------------
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = PRODUCTION
CSRF_COOKIE_SECURE = PRODUCTION
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
# HTML pages (apps.core.middleware): the portal's and the admin's load everything from
# this origin and run no inline script; style attributes only (meters' widths).
HETEROFLOW_CSP = env.str(
    "HETEROFLOW_CSP",
    "default-src 'self'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self'; connect-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'",
)
# Pages with inline code of their own get the policy with that allowed, by path prefix:
# the API documentation (drf-spectacular's Swagger UI: an inline script and style block;
# it shows the public schema only) and the admin (django-tenants' and Django's admin
# templates have inline <style> blocks; its scripts stay 'self' only).
HETEROFLOW_CSP_BY_PATH = {
    "/api/docs/": (
        "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'self'; frame-ancestors 'none'"
    ),
    "/admin/": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
}
# The portal's terminal page sets its own (apps.portal.pages.terminal): xterm.js writes its
# measured cell sizes and colours into <style> elements it makes; scripts stay 'self' only.
HETEROFLOW_CSP_TERMINAL = env.str(
    "HETEROFLOW_CSP_TERMINAL",
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'none'",
)
HETEROFLOW_PERMISSIONS_POLICY = "camera=(), microphone=(), geolocation=(), payment=(), usb=()"
SECURE_SSL_REDIRECT = env.bool("HETEROFLOW_SSL_REDIRECT", PRODUCTION)
SECURE_HSTS_SECONDS = env.int("HETEROFLOW_HSTS_SECONDS", 31_536_000 if PRODUCTION else 0, low=0, high=63_072_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("HETEROFLOW_HSTS_INCLUDE_SUBDOMAINS", PRODUCTION)
SECURE_HSTS_PRELOAD = env.bool("HETEROFLOW_HSTS_PRELOAD", PRODUCTION)
if env.bool("HETEROFLOW_BEHIND_TLS_PROXY", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# --- the tunnel (docs/tunnel.md) ---------------------------------------------------------
# The tunnel process (`manage.py tunnel`) takes the agents' outbound connections on
# HOST:PORT; agents dial PUBLIC_HOST:PUBLIC_PORT ("" host: the host of their server_url).
# The web processes reach it on its relay address (RELAY_HOST:RELAY_PORT, told to the other
# instances through Redis as RELAY_ADVERTISE, default the same). A user's session ends
# after IDLE_SECONDS without a byte either way, and after MAX_SECONDS whatever it does.
# (HOST "": every interface, since the fleet's agents dial in)
HETEROFLOW_TUNNEL_HOST = env.str("HETEROFLOW_TUNNEL_HOST", "")
HETEROFLOW_TUNNEL_PORT = env.int("HETEROFLOW_TUNNEL_PORT", 3322, low=0, high=65535)
HETEROFLOW_TUNNEL_PUBLIC_HOST = env.str("HETEROFLOW_TUNNEL_PUBLIC_HOST", "")
HETEROFLOW_TUNNEL_PUBLIC_PORT = env.int("HETEROFLOW_TUNNEL_PUBLIC_PORT", 0, low=0, high=65535)  # 0: TUNNEL_PORT
HETEROFLOW_TUNNEL_RELAY_HOST = env.str("HETEROFLOW_TUNNEL_RELAY_HOST", "127.0.0.1")
HETEROFLOW_TUNNEL_RELAY_PORT = env.int("HETEROFLOW_TUNNEL_RELAY_PORT", 3323, low=0, high=65535)
HETEROFLOW_TUNNEL_RELAY_ADVERTISE = env.str("HETEROFLOW_TUNNEL_RELAY_ADVERTISE", "")
HETEROFLOW_TUNNEL_IDLE_SECONDS = env.int("HETEROFLOW_TUNNEL_IDLE_SECONDS", 1_800, low=5, high=86_400)
HETEROFLOW_TUNNEL_MAX_SECONDS = env.int("HETEROFLOW_TUNNEL_MAX_SECONDS", 43_200, low=10, high=604_800)
HETEROFLOW_TUNNEL_DB_POOL_SIZE = env.int("HETEROFLOW_TUNNEL_DB_POOL_SIZE", 4, low=1, high=100)

# --- logging --------------------------------------------------------------------------
LOG_LEVEL = env.choice("HETEROFLOW_LOG_LEVEL", "info", ("debug", "info", "warning", "error"))
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "level": LOG_LEVEL.upper()}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL.upper()},
    "loggers": {"django.db.backends": {"level": "WARNING"}, "httpx": {"level": "WARNING"}},
}

# --- sign-in with the company's identity (docs/identity.md) ------------------------------
# OpenID Connect providers, by name: HETEROFLOW_OIDC_PROVIDERS=keycloak,entra, then for each
# HETEROFLOW_OIDC_<NAME>_ISSUER (discovery: ISSUER/.well-known/openid-configuration),
# _CLIENT_ID, _CLIENT_SECRET, and optionally _LABEL (the button), _SCOPES, _GROUPS_CLAIM,
# _USERNAME_CLAIM. The redirect URI to register: https://HOST/identity/oidc/<name>/callback.
HETEROFLOW_OIDC_PROVIDERS = {}
for _name in env.list("HETEROFLOW_OIDC_PROVIDERS", []):
    _name = _name.lower()
    _prefix = "HETEROFLOW_OIDC_" + _name.upper().replace("-", "_") + "_"
    if not _name.replace("-", "").isalnum():
        raise ImproperlyConfigured(f"HETEROFLOW_OIDC_PROVIDERS: {_name!r} is not a name of letters, digits and '-'")
    HETEROFLOW_OIDC_PROVIDERS[_name] = {
        "issuer": env.str(_prefix + "ISSUER"),
        "client_id": env.str(_prefix + "CLIENT_ID"),
        "client_secret": env.str(_prefix + "CLIENT_SECRET", ""),
        "label": env.str(_prefix + "LABEL", _name),
        "scopes": env.str(_prefix + "SCOPES", "openid profile email"),
        "groups_claim": env.str(_prefix + "GROUPS_CLAIM", "groups"),
        "username_claim": env.str(_prefix + "USERNAME_CLAIM", "preferred_username"),
    }
    for _field in ("issuer", "client_id"):
        if not HETEROFLOW_OIDC_PROVIDERS[_name][_field]:
            raise ImproperlyConfigured(f"{_prefix}{_field.upper()} is required (provider {_name!r})")
# How far the provider's clock may be off when an ID token's exp and iat are checked.
HETEROFLOW_OIDC_CLOCK_SKEW_SECONDS = env.int("HETEROFLOW_OIDC_CLOCK_SKEW_SECONDS", 60, low=0, high=600)
# false: the sign-in form's local passwords work only for break-glass operators (staff
# users with no directory account); everyone else signs in through a provider or LDAP.
HETEROFLOW_LOCAL_SIGN_IN = env.bool("HETEROFLOW_LOCAL_SIGN_IN", True)
# Sessions: at most LIFETIME after sign-in, ended after IDLE without a request (0: never),
# and creating an API key asks for a sign-in within REAUTH (0: never asks).
HETEROFLOW_SESSION_LIFETIME_SECONDS = env.int("HETEROFLOW_SESSION_LIFETIME_SECONDS", 1_209_600, low=60, high=31_536_000)
HETEROFLOW_SESSION_IDLE_SECONDS = env.int("HETEROFLOW_SESSION_IDLE_SECONDS", 0, low=0, high=31_536_000)
HETEROFLOW_REAUTH_SECONDS = env.int("HETEROFLOW_REAUTH_SECONDS", 0, low=0, high=86_400)
SESSION_COOKIE_AGE = HETEROFLOW_SESSION_LIFETIME_SECONDS
AUTHENTICATION_BACKENDS = [
    "apps.identity.backends.LocalPasswordBackend" if path == "django.contrib.auth.backends.ModelBackend" else path
    for path in AUTHENTICATION_BACKENDS
] + ["apps.identity.backends.DirectoryBackend"]
MIDDLEWARE.insert(
    MIDDLEWARE.index("django.contrib.auth.middleware.AuthenticationMiddleware") + 1,
    "apps.identity.session.SessionIdleMiddleware",
)
# LDAP / Active Directory (apps.identity.directory_ldap, on django-auth-ldap: pip install -r
# requirements/ldap.txt). On when SERVER_URI is set (ldap://HOST:389 with START_TLS, or
# ldaps://HOST:636); BIND_DN empty: anonymous search. People are found under
# USER_SEARCH_BASE by USER_FILTER, their groups under GROUP_SEARCH_BASE (GROUP_TYPE:
# groupofnames, groupofuniquenames, posixgroup or activedirectory, nested groups followed).
HETEROFLOW_LDAP_SERVER_URI = env.str("HETEROFLOW_LDAP_SERVER_URI", "")
HETEROFLOW_LDAP_BIND_DN = env.str("HETEROFLOW_LDAP_BIND_DN", "")
HETEROFLOW_LDAP_BIND_PASSWORD = env.str("HETEROFLOW_LDAP_BIND_PASSWORD", "")
HETEROFLOW_LDAP_START_TLS = env.bool("HETEROFLOW_LDAP_START_TLS", False)
HETEROFLOW_LDAP_CA_FILE = env.str("HETEROFLOW_LDAP_CA_FILE", "")
HETEROFLOW_LDAP_USER_SEARCH_BASE = env.str("HETEROFLOW_LDAP_USER_SEARCH_BASE", "")
HETEROFLOW_LDAP_USER_FILTER = env.str("HETEROFLOW_LDAP_USER_FILTER", "(uid=%(user)s)")
HETEROFLOW_LDAP_GROUP_SEARCH_BASE = env.str("HETEROFLOW_LDAP_GROUP_SEARCH_BASE", "")
HETEROFLOW_LDAP_GROUP_FILTER = env.str("HETEROFLOW_LDAP_GROUP_FILTER", "(objectClass=groupOfNames)")
HETEROFLOW_LDAP_GROUP_TYPE = env.choice(
    "HETEROFLOW_LDAP_GROUP_TYPE",
    "groupofnames",
    ("groupofnames", "groupofuniquenames", "posixgroup", "activedirectory"),
)
HETEROFLOW_LDAP_TIMEOUT_SECONDS = env.int("HETEROFLOW_LDAP_TIMEOUT_SECONDS", 5, low=1, high=60)
if HETEROFLOW_LDAP_SERVER_URI:
    if not HETEROFLOW_LDAP_USER_SEARCH_BASE or not HETEROFLOW_LDAP_GROUP_SEARCH_BASE:
        raise ImproperlyConfigured(
            "HETEROFLOW_LDAP_SERVER_URI needs HETEROFLOW_LDAP_USER_SEARCH_BASE and HETEROFLOW_LDAP_GROUP_SEARCH_BASE"
        )
    try:
        import django_auth_ldap  # noqa: F401
    except ImportError:
        raise ImproperlyConfigured(
            "HETEROFLOW_LDAP_SERVER_URI is set but django-auth-ldap is not installed: "
            "pip install -r requirements/ldap.txt (python-ldap needs libldap2-dev libsasl2-dev gcc)"
        ) from None
    AUTHENTICATION_BACKENDS.insert(
        AUTHENTICATION_BACKENDS.index("apps.identity.backends.DirectoryBackend"),
        "apps.identity.directory_ldap.DirectoryLDAPBackend",
    )
