"""The real identity providers the identity tests sign in against, one process each per
machine, shared by every test module: npm's oidc-provider (scripts/oidc-provider.sh) and
Debian's slapd (scripts/ldap.sh). A module that needs one calls its function; without it
the module skips saying why, and in CI (HETEROFLOW_REQUIRE_IDENTITY=1, set by .ci/run,
which starts both) fails instead."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OIDC_CLIENT_ID = "heteroflow"
# the name the provider's client has its redirect URI for (scripts/oidc-provider.mjs)
OIDC_PROVIDER_NAME = "test"


def _unavailable(why: str, how: str):
    if os.environ.get("HETEROFLOW_REQUIRE_IDENTITY") == "1":
        pytest.fail(f"HETEROFLOW_REQUIRE_IDENTITY=1 but {why} ({how})")
    pytest.skip(f"{why} ({how})")


def _started(script: str) -> dict:
    """The env the script prints after starting its provider (or finding it up)."""
    run = subprocess.run(["bash", str(REPO / "scripts" / script), "start"], capture_output=True, text=True, timeout=90)
    if run.returncode != 0:
        _unavailable(
            f"scripts/{script} start failed: {run.stderr.strip()[-400:]}",
            f"bash scripts/{script} --install start",
        )
    env = {}
    for line in run.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value
    return env


def oidc_provider() -> dict:
    """{"issuer", "secret", "users": Path} of the running oidc-provider."""
    env = _started("oidc-provider.sh")
    return {
        "issuer": env["HETEROFLOW_TEST_OIDC_ISSUER"],
        "secret": env["HETEROFLOW_TEST_OIDC_CLIENT_SECRET"],
        "users": Path(env["HETEROFLOW_TEST_OIDC_USERS"]),
    }


def set_oidc_people(provider: dict, people: dict) -> None:
    """Add or change people ({"login": {"groups": [...]}}): the provider reads the file at
    every sign-in. Others' entries are kept (the provider is shared)."""
    path = provider["users"]
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker's module may be writing its own people
        current = json.loads(path.read_text() or "{}") if path.exists() else {}
        current.update(people)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(current))
        temporary.replace(path)


def oidc_settings(provider: dict, label: str = "Corp SSO") -> dict:
    """The environment that configures the control plane for it."""
    prefix = f"HETEROFLOW_OIDC_{OIDC_PROVIDER_NAME.upper()}_"
    return {
        "HETEROFLOW_OIDC_PROVIDERS": OIDC_PROVIDER_NAME,
        prefix + "ISSUER": provider["issuer"],
        prefix + "CLIENT_ID": OIDC_CLIENT_ID,
        prefix + "CLIENT_SECRET": provider["secret"],
        prefix + "LABEL": label,
        prefix + "SCOPES": "openid profile email groups",
    }


def ldap_directory() -> dict:
    """{"uri", "ca_file", "base"} of the running slapd (StartTLS only), with python-ldap
    and django-auth-ldap importable."""
    try:
        import django_auth_ldap  # noqa: F401
        import ldap  # noqa: F401
    except ImportError as exc:
        _unavailable(f"the LDAP client is not installed ({exc})", "bash scripts/ldap.sh --install start")
    env = _started("ldap.sh")
    return {
        "uri": env["HETEROFLOW_TEST_LDAP_URI"],
        "ldaps_uri": env["HETEROFLOW_TEST_LDAPS_URI"],
        "ca_file": env["HETEROFLOW_TEST_LDAP_CA_FILE"],
        "base": env["HETEROFLOW_TEST_LDAP_BASE"],
    }


def ldap_settings(directory: dict, *, bind: bool = True, start_tls: bool = True, ldaps: bool = False) -> dict:
    """The environment that configures the control plane for it (as the bind DN's service
    account, or searching anonymously; StartTLS, or LDAPS)."""
    base = directory["base"]
    return {
        "HETEROFLOW_LDAP_SERVER_URI": directory["ldaps_uri" if ldaps else "uri"],
        "HETEROFLOW_LDAP_BIND_DN": f"uid=heteroflow-bind,ou=people,{base}" if bind else "",
        "HETEROFLOW_LDAP_BIND_PASSWORD": "bind-pw" if bind else "",
        "HETEROFLOW_LDAP_START_TLS": "true" if start_tls and not ldaps else "false",
        "HETEROFLOW_LDAP_CA_FILE": directory["ca_file"],
        "HETEROFLOW_LDAP_USER_SEARCH_BASE": f"ou=people,{base}",
        "HETEROFLOW_LDAP_GROUP_SEARCH_BASE": f"ou=groups,{base}",
    }


def ldap_group_dn(directory: dict, name: str) -> str:
    return f"cn={name},ou=groups,{directory['base']}"


def set_ldap_member(directory: dict, group: str, uid: str, member: bool) -> None:
    """Add `uid` to the directory's `group` or take them out, as the directory's admin."""
    import ldap

    connection = ldap.initialize(directory["uri"])
    connection.set_option(ldap.OPT_X_TLS_CACERTFILE, directory["ca_file"])
    connection.set_option(ldap.OPT_X_TLS_NEWCTX, 0)
    connection.start_tls_s()
    connection.simple_bind_s(f"cn=admin,{directory['base']}", "admin-pw")
    person = f"uid={uid},ou=people,{directory['base']}".encode()
    change = (ldap.MOD_ADD if member else ldap.MOD_DELETE, "member", [person])
    try:
        connection.modify_s(ldap_group_dn(directory, group), [change])
    except (ldap.TYPE_OR_VALUE_EXISTS, ldap.NO_SUCH_ATTRIBUTE):
        return  # already so: the test asked for the state it has
    finally:
        connection.unbind_s()
