"""The mapping table (GET/PUT /api/v1/admin/identity/mappings, the admin) and what a
directory sign-in does with it (apps.identity.services.sign_in)."""

import pytest
from django.contrib.auth import get_user_model

from apps.core.models import OperatorAuditEvent
from apps.identity import services
from apps.identity.models import DirectoryIdentity, GroupMapping
from apps.identity.services import DirectoryAccount, SignInRefused
from apps.tenants.models import ApiKey, Membership
from tests.headers import bearer
from tests.identity.support import tenant_log

pytestmark = pytest.mark.django_db
User = get_user_model()
URL = "/api/v1/admin/identity/mappings"


def put(api, world, rows, key=None):
    return api.put(URL, {"mappings": rows}, format="json", **bearer(key or world.operator_key))


def account(subject="alice-sub", groups=(), username="alice", source="oidc:corp"):
    return DirectoryAccount(
        source=source, subject=subject, username=username, email=f"{username}@corp.test", groups=tuple(groups)
    )


# --- the API ----------------------------------------------------------------------------


def test_an_operator_replaces_and_reads_the_table(world, api):
    rows = [
        {"group": "gpu-users", "tenant": "acme", "role": "member"},
        {"group": "cn=ops,ou=groups,dc=corp", "operator": True},
        {"group": "gpu-users", "tenant": "beta", "role": "viewer"},
    ]
    response = put(api, world, rows)
    assert response.status_code == 200, response.json()
    assert response.json()["mappings"] == [
        {"group": "cn=ops,ou=groups,dc=corp", "tenant": None, "role": None, "operator": True},
        {"group": "gpu-users", "tenant": "acme", "role": "member", "operator": False},
        {"group": "gpu-users", "tenant": "beta", "role": "viewer", "operator": False},
    ]
    assert api.get(URL, **bearer(world.operator_key)).json() == response.json()
    # replaced whole: a second PUT leaves only its rows
    assert put(api, world, [{"group": "x", "tenant": "acme", "role": "admin"}]).status_code == 200
    assert list(GroupMapping.objects.values_list("group", flat=True)) == ["x"]
    replaced = OperatorAuditEvent.objects.filter(action="identity.mappings_replaced", actor__startswith="op (key")
    assert replaced.count() == 2


@pytest.mark.parametrize(
    "row, field_words",
    [
        ({"group": "g", "tenant": "nope", "role": "member"}, "does not exist"),
        ({"group": "g", "tenant": "acme", "role": "owner"}, "not a valid choice"),
        ({"group": "g", "tenant": "acme"}, "names a tenant and a role"),
        ({"group": "g", "operator": True, "tenant": "acme"}, "names no tenant"),
        ({"group": "  ", "tenant": "acme", "role": "member"}, "blank"),
        ({"group": "g", "tenant": "acme", "role": "member", "colour": "red"}, "Unknown field"),
    ],
)
def test_bad_rows_are_a_400_and_nothing_is_written(world, api, row, field_words):
    put(api, world, [{"group": "kept", "tenant": "acme", "role": "member"}])
    response = put(api, world, [{"group": "fine", "tenant": "beta", "role": "member"}, row])
    assert response.status_code == 400
    assert field_words in str(response.json())
    assert list(GroupMapping.objects.values_list("group", flat=True)) == ["kept"]


def test_the_same_group_twice_for_one_tenant_is_a_400(world, api):
    rows = [{"group": "G", "tenant": "acme", "role": "member"}, {"group": "g", "tenant": "acme", "role": "admin"}]
    response = put(api, world, rows)
    assert response.status_code == 400
    assert "maps to tenant 'acme' twice" in str(response.json())


@pytest.mark.parametrize("who", ["acme-admin", "acme-member"])
def test_only_operators_read_or_write_the_table(world, api, who):
    assert api.get(URL, **bearer(world.keys[who])).status_code == 403
    assert put(api, world, [], key=world.keys[who]).status_code == 403
    assert api.get(URL).status_code in (401, 403)


# --- the admin ---------------------------------------------------------------------------


def test_the_admin_adds_a_mapping_and_refuses_a_half_one(world, client):
    client.force_login(world.operator)
    tenant = world.tenants["acme"]
    added = client.post(
        "/admin/identity/groupmapping/add/", {"group": "researchers", "tenant": tenant.pk, "role": "viewer"}
    )
    assert added.status_code == 302
    assert GroupMapping.objects.get(group="researchers").role == "viewer"
    half = client.post("/admin/identity/groupmapping/add/", {"group": "half", "tenant": tenant.pk, "role": ""})
    assert half.status_code == 200 and b"names a tenant and a role" in half.content
    twice = client.post(
        "/admin/identity/groupmapping/add/", {"group": "RESEARCHERS", "tenant": tenant.pk, "role": "admin"}
    )
    assert twice.status_code == 200 and b"mapped there already" in twice.content
    assert OperatorAuditEvent.objects.filter(action="identity.mapping_added").count() == 1


# --- sign-in -------------------------------------------------------------------------------


def map_groups(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    GroupMapping.objects.create(group="acme-users", tenant=acme, role="member")
    GroupMapping.objects.create(group="acme-leads", tenant=acme, role="admin")
    GroupMapping.objects.create(group="CN=Beta,OU=Groups,DC=corp", tenant=beta, role="viewer")
    GroupMapping.objects.create(group="platform-ops", operator=True)


def test_a_first_sign_in_creates_the_user_with_the_highest_mapped_role_and_audits_it(world):
    map_groups(world)
    user = services.sign_in(account(groups=["acme-users", "acme-leads", "cn=beta,ou=groups,dc=corp", "unmapped"]))
    assert user.username == "alice" and not user.has_usable_password()
    roles = dict(Membership.objects.filter(user=user).values_list("tenant__slug", "role"))
    assert roles == {"acme": "admin", "beta": "viewer"}
    assert not user.is_staff
    created = OperatorAuditEvent.objects.get(action="identity.user_created")
    assert created.target == "alice" and created.details["source"] == "oidc:corp"
    assert tenant_log(world.tenants["acme"], "member.added", "alice").actor == "directory (oidc:corp)"
    identity = DirectoryIdentity.objects.get(user=user)
    assert identity.subject == "alice-sub" and "acme-users" in identity.groups


def test_the_next_sign_in_follows_the_groups_and_a_lost_membership_kills_its_keys_at_once(world, api):
    from apps.core.principals import Principal, PrincipalKind
    from apps.tenants import services as tenancy

    map_groups(world)
    user = services.sign_in(account(groups=["acme-users", "CN=Beta,OU=Groups,DC=corp"]))
    acme = world.tenants["acme"]
    owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=acme, role="member")
    key = tenancy.issue_tenant_key(principal=owner, tenant=acme, owner=user, name="laptop").key
    assert api.get("/api/v1/me", **bearer(key)).status_code == 200

    again = services.sign_in(account(groups=["CN=Beta,OU=Groups,DC=corp", "acme-leads"]))
    assert again.pk == user.pk
    assert dict(Membership.objects.filter(user=user).values_list("tenant__slug", "role")) == {
        "acme": "admin",
        "beta": "viewer",
    }
    services.sign_in(account(groups=["CN=Beta,OU=Groups,DC=corp"]))
    assert list(Membership.objects.filter(user=user).values_list("tenant__slug", flat=True)) == ["beta"]
    assert api.get("/api/v1/me", **bearer(key)).status_code == 401
    assert ApiKey.objects.get(name="laptop").revoked_at is not None


def test_operator_groups_make_and_unmake_a_platform_operator(world, api):
    map_groups(world)
    user = services.sign_in(account(groups=["platform-ops"]))
    assert user.is_staff and user.is_superuser
    from apps.tenants import services as tenancy

    platform_key = tenancy.issue_platform_key(user=user, name="ops").key
    assert api.get("/api/v1/admin/identity/mappings", **bearer(platform_key)).status_code == 200
    user = services.sign_in(account(groups=["acme-users"]))
    assert not user.is_staff and not user.is_superuser
    assert api.get("/api/v1/admin/identity/mappings", **bearer(platform_key)).status_code == 401
    actions = set(OperatorAuditEvent.objects.values_list("action", flat=True))
    assert {"identity.operator_granted", "identity.operator_revoked"} <= actions


def test_no_mapped_group_is_refused_audited_and_takes_away_what_was_had(world):
    map_groups(world)
    with pytest.raises(SignInRefused) as refused:
        services.sign_in(account(subject="bob-sub", username="bob", groups=["nobody-maps-this"]))
    assert "None of your directory groups" in refused.value.reason
    assert not User.objects.filter(username="bob").exists()  # nobody is created for a refusal
    event = OperatorAuditEvent.objects.get(action="identity.sign_in_refused")
    assert event.target == "bob" and event.details["groups"] == ["nobody-maps-this"]

    user = services.sign_in(account(groups=["acme-users"]))
    with pytest.raises(SignInRefused):
        services.sign_in(account(groups=[]))
    assert not Membership.objects.filter(user=user).exists()


def test_the_directory_may_take_a_tenants_last_admin_away(world):
    acme = world.tenants["acme"]
    GroupMapping.objects.create(group="acme-leads", tenant=acme, role="admin")
    GroupMapping.objects.create(group="acme-users", tenant=acme, role="member")
    Membership.objects.filter(tenant=acme, role="admin").delete()
    user = services.sign_in(account(groups=["acme-leads"]))
    services.sign_in(account(groups=["acme-users"]))
    assert Membership.objects.get(user=user, tenant=acme).role == "member"


def test_a_local_account_of_the_same_name_is_never_taken_over(world):
    map_groups(world)
    local = User.objects.create_user(username="acme-admin-twin", password="local-pw-1234")
    user = services.sign_in(account(subject="s-1", username="acme-admin-twin", groups=["acme-users"]))
    assert user.pk != local.pk and user.username == "acme-admin-twin@corp"
    assert local.check_password("local-pw-1234")


def test_a_disabled_user_is_refused_even_with_mapped_groups(world):
    map_groups(world)
    user = services.sign_in(account(groups=["acme-users"]))
    User.objects.filter(pk=user.pk).update(is_active=False)
    with pytest.raises(SignInRefused) as refused:
        services.sign_in(account(groups=["acme-users"]))
    assert "disabled" in refused.value.reason
    assert not Membership.objects.filter(user=user).exists()
