"""The production start-up posture check.

Production mode refuses to start rather than run with a value that lets anyone in:
this function lists every problem so the operator can fix them all in one go.
"""

from __future__ import annotations

DEV_SECRET_KEY = "heteroflow-insecure-development-key-do-not-use-in-production"
DEV_AGENT_SECRET = "heteroflow-dev-agent-secret"
MIN_AGENT_SECRET_LENGTH = 16
MIN_SECRET_KEY_LENGTH = 50  # what Django's own deploy check asks for

# Values that appear in docs, examples and old installers; anyone could guess them.
KNOWN_DEFAULT_AGENT_SECRETS = frozenset(
    {
        DEV_AGENT_SECRET,
        "changeme",
        "change-me",
        "changeme-agent-secret",
        "heteroflow",
        "heteroflow-agent",
        "heteroflow-agent-secret",
        "agent-secret",
        "agent_secret",
        "default",
        "default-agent-secret",
        "secret",
        "password",
        "your-agent-secret",
        "your-agent-secret-here",
    }
)
KNOWN_DEFAULT_SECRET_KEYS = frozenset(
    {DEV_SECRET_KEY, "changeme", "change-me", "secret", "secret-key", "django-insecure"}
)


def production_problems(
    *, secret_key: str | None, debug: bool, allowed_hosts: list[str], agent_secret: str | None
) -> list[str]:
    problems: list[str] = []
    if not agent_secret:
        problems.append("HETEROFLOW_AGENT_SECRET is not set")
    elif agent_secret.lower() in KNOWN_DEFAULT_AGENT_SECRETS:
        problems.append("HETEROFLOW_AGENT_SECRET is a well-known default value")
    elif len(agent_secret) < MIN_AGENT_SECRET_LENGTH:
        problems.append(f"HETEROFLOW_AGENT_SECRET is shorter than {MIN_AGENT_SECRET_LENGTH} characters")
    if not secret_key:
        problems.append("SECRET_KEY is not set")
    elif secret_key.lower() in KNOWN_DEFAULT_SECRET_KEYS or secret_key.startswith("django-insecure"):
        problems.append("SECRET_KEY is a well-known default value")
    elif len(secret_key) < MIN_SECRET_KEY_LENGTH:
        problems.append(f"SECRET_KEY is shorter than {MIN_SECRET_KEY_LENGTH} characters")
    if debug:
        problems.append("DEBUG is on")
    if not allowed_hosts:
        problems.append("ALLOWED_HOSTS is empty")
    elif any("*" in host for host in allowed_hosts):
        problems.append("ALLOWED_HOSTS contains a wildcard ('*')")
    return problems
