# HeteroFlow control plane: one image for web, Celery worker, Celery beat and the
# one-shot migrate/bootstrap step. See docs/deployment.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=heteroflow.settings \
    HETEROFLOW_ENV=production \
    HETEROFLOW_DATA_DIR=/data

WORKDIR /app

# Dependencies first, so that code changes do not reinstall them.
COPY requirements/base.txt requirements/base.txt
RUN pip install -r requirements/base.txt

COPY . .

# Static files are collected into STATIC_ROOT = $HETEROFLOW_DATA_DIR/static (/data/static),
# where servestatic serves them in production. The settings refuse to load without
# DATABASE_URL and REDIS_URL, but nothing connects at import or during collectstatic,
# so dummy values are enough, and only for this step. Development mode avoids the
# production refusals (no secrets exist at build time); the collected files are the same.
RUN HETEROFLOW_ENV=development \
    DATABASE_URL=postgresql://build@localhost/build \
    REDIS_URL=redis://localhost:6379/0 \
    python manage.py collectstatic --noinput

RUN useradd --system --uid 10001 --user-group --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin heteroflow \
    && chown -R heteroflow:heteroflow /data \
    && chmod 700 /data

USER heteroflow

EXPOSE 3333

CMD ["uvicorn", "heteroflow.asgi:application", "--host", "0.0.0.0", "--port", "3333", "--workers", "2", "--lifespan", "on", "--no-proxy-headers", "--timeout-graceful-shutdown", "5"]
