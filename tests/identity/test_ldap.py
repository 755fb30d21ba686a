"""LDAP sign-in through the sign-in form against a real slapd (scripts/ldap.sh: StartTLS
and LDAPS with a CA of its own, every operation refused without TLS): found as the bind
DN's service account or anonymously, the groups found by a group search and mapped; a group
change counts at the next sign-in; a person with no mapped group gets the refusal page;
without StartTLS, or trusting another CA, nobody signs in."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client, override_settings

from apps.core.models import OperatorAuditEvent
from apps.identity.models import DirectoryIdentity, GroupMapping
from apps.tenants.models import Membership
from tests.identity.providers import ldap_directory, ldap_group_dn, ldap_settings, set_ldap_member

pytestmark = pytest.mark.django_db
User = get_user_model()
BACKENDS = [
    "apps.core.login_limits.LockoutBackend",
    "apps.identity.backends.LocalPasswordBackend",
    "apps.identity.directory_ldap.DirectoryLDAPBackend",
    "apps.identity.backends.DirectoryBackend",
]


@pytest.fixture(scope="module")
def directory():
    return ldap_directory()


def configured(directory, **changes):
    overrides = {name: value for name, value in ldap_settings(directory, **changes).items()}
    overrides["HETEROFLOW_LDAP_START_TLS"] = overrides["HETEROFLOW_LDAP_START_TLS"] == "true"
    return override_settings(AUTHENTICATION_BACKENDS=BACKENDS, **overrides)


@pytest.fixture
def mapped(world, directory):
    acme = world.tenants["acme"]
    GroupMapping.objects.create(group=ldap_group_dn(directory, "gpu-users"), tenant=acme, role="member")
    GroupMapping.objects.create(group=ldap_group_dn(directory, "gpu-admins"), tenant=acme, role="admin")
    return acme


def sign_in(username, password, address="198.51.100.40"):
    client = Client(REMOTE_ADDR=address)
    response = client.post("/portal/login/", {"username": username, "password": password})
    return client, response


def roles_of(username):
    return dict(Membership.objects.filter(user__username=username).values_list("tenant__slug", "role"))


@pytest.mark.parametrize(
    "bind, ldaps", [(True, False), (False, False), (True, True)], ids=["bind-dn", "anonymous-search", "ldaps"]
)
def test_a_person_signs_in_over_tls_into_the_mapped_tenant(directory, mapped, bind, ldaps):
    with configured(directory, bind=bind, ldaps=ldaps):
        client, response = sign_in("carol", "carol-pw")
    assert response.status_code == 302, response.content[:400]
    assert "_auth_user_id" in client.session
    assert roles_of("carol") == {"acme": "member"}
    user = User.objects.get(username="carol")
    assert user.email == "carol@corp.test" and not user.has_usable_password()
    assert DirectoryIdentity.objects.get(user=user).source == "ldap"
    assert OperatorAuditEvent.objects.filter(action="identity.user_created", target="carol").exists()


def test_a_wrong_password_is_the_forms_error(directory, mapped):
    with configured(directory):
        client, response = sign_in("carol", "not-carols")
    assert response.status_code == 200 and b"did not match" in response.content
    assert "_auth_user_id" not in client.session


def test_a_group_change_counts_at_the_next_sign_in(directory, mapped):
    with configured(directory):
        assert sign_in("carol", "carol-pw")[1].status_code == 302
        assert roles_of("carol") == {"acme": "member"}
        set_ldap_member(directory, "gpu-admins", "carol", True)
        try:
            assert sign_in("carol", "carol-pw")[1].status_code == 302
            assert roles_of("carol") == {"acme": "admin"}
        finally:
            set_ldap_member(directory, "gpu-admins", "carol", False)
        assert sign_in("carol", "carol-pw")[1].status_code == 302
        assert roles_of("carol") == {"acme": "member"}


def test_a_person_with_no_mapped_group_gets_the_refusal_page(directory, mapped):
    with configured(directory):
        client, response = sign_in("dave", "dave-pw")
    assert response.status_code == 403
    assert b"None of your directory groups" in response.content
    assert "_auth_user_id" not in client.session
    assert not User.objects.filter(username="dave").exists()
    event = OperatorAuditEvent.objects.get(action="identity.sign_in_refused", target="dave")
    assert event.details["groups"] == [ldap_group_dn(directory, "sales")]


def test_without_starttls_the_directory_refuses_and_nobody_signs_in(directory, mapped):
    with configured(directory, start_tls=False):
        client, response = sign_in("carol", "carol-pw")
    assert response.status_code == 200 and "_auth_user_id" not in client.session


def test_a_server_certificate_from_another_ca_is_refused(directory, mapped, tmp_path):
    import subprocess

    other_ca = tmp_path / "other-ca.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=Other CA",
         "-keyout", str(tmp_path / "other.key"), "-out", str(other_ca)],
        check=True, capture_output=True,
    )  # fmt: skip
    with configured(directory), override_settings(HETEROFLOW_LDAP_CA_FILE=str(other_ca)):
        client, response = sign_in("carol", "carol-pw")
    assert response.status_code == 200 and "_auth_user_id" not in client.session
