"""The tunnel's pieces without processes: a node's host key registration through the real
ASGI route (pinned on first use, a second key refused, one key one node, bad input
refused with nothing written), the relay's signed header (forged, altered and expired
ones refused), and a session's idle timeout and maximum length."""

from __future__ import annotations

import asyncio
import time

import asyncssh
import httpx
import pytest
import time_machine

from apps.tunnel import keys
from apps.tunnel.api.routes import TunnelRegisterApp
from apps.tunnel.choices import SessionOutcome
from apps.tunnel.models import TunnelHostKey
from apps.tunnel.server import Session
from tests.factories import make_node
from tests.headers import AGENT_HTTP

pytestmark = pytest.mark.django_db(transaction=True)


async def _django(scope, receive, send):
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"django"})


def register(node_id: str, body, headers=AGENT_HTTP) -> httpx.Response:
    async def go():
        app = TunnelRegisterApp(_django)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                return await client.post(f"/api/v1/nodes/{node_id}/tunnel", json=body, headers=headers)
        finally:
            await app.close()

    return asyncio.run(go())


def public(key: asyncssh.SSHKey) -> str:
    return key.export_public_key().decode().strip()


def test_the_first_key_is_pinned_and_another_is_refused():
    make_node("n1")
    first, second = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    answer = register("n1", {"host_key": public(first) + " root@n1"})  # a comment is not part of the key
    assert answer.status_code == 200, answer.text
    assert asyncssh.import_public_key(answer.json()["client_key"]).public_data == keys.client_key().public_data
    assert answer.json()["port"] > 0
    pinned = TunnelHostKey.objects.get(node_id="n1")
    assert pinned.fingerprint == first.get_fingerprint("sha256") and pinned.public_key == public(first)

    assert register("n1", {"host_key": public(first)}).status_code == 200  # the same key again: fine
    refused = register("n1", {"host_key": public(second)})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "host_key_mismatch"
    assert TunnelHostKey.objects.get(node_id="n1").public_key == public(first)

    make_node("n2")
    taken = register("n2", {"host_key": public(first)})  # one key, one node: the process names nodes by it
    assert taken.status_code == 409 and not TunnelHostKey.objects.filter(node_id="n2").exists()

    TunnelHostKey.objects.filter(node_id="n1").delete()  # an operator forgets it (a reinstalled node)
    assert register("n1", {"host_key": public(second)}).status_code == 200


def test_bad_registrations_write_nothing():
    make_node("n1")
    rsa = asyncssh.generate_private_key("ssh-rsa", key_size=2048)
    for body in ({}, {"host_key": "ssh-ed25519 not-base64!"}, {"host_key": public(rsa)}, ["x"]):
        answer = register("n1", body)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid", body
    unknown = register("n9", {"host_key": public(asyncssh.generate_private_key("ssh-ed25519"))})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "node_unknown"
    anonymous = register("n1", {"host_key": public(asyncssh.generate_private_key("ssh-ed25519"))}, headers={})
    assert anonymous.status_code == 401
    assert not TunnelHostKey.objects.exists()


def test_a_relay_header_is_good_only_as_signed_and_in_time():
    line = keys.sign({"node": "n1", "task": 7, "kind": "port", "port": 80}, now=1000.0)
    assert keys.verify(line, now=1001.0)["task"] == 7
    assert keys.verify(line, now=1000.0 + keys.HEADER_TTL_SECONDS + 1) is None  # expired
    assert keys.verify(line.replace(b'\\"task\\":7', b'\\"task\\":8'), now=1001.0) is None  # altered
    assert keys.verify(b'{"h": "{}", "mac": "00"}', now=1001.0) is None  # forged
    assert keys.verify(b"not json", now=1001.0) is None


def test_a_session_ends_when_idle_or_too_long():
    async def ends(session: Session, busy: bool) -> tuple[str, float]:
        started = time.monotonic()
        watcher = asyncio.ensure_future(session.watch())
        while not watcher.done():
            if busy:
                session.moved(inbound=1)
            await asyncio.sleep(0.05)
        return session.outcome, time.monotonic() - started

    outcome, took = asyncio.run(ends(Session(idle=0.3, longest=60), busy=False))
    assert outcome == SessionOutcome.IDLE and 0.3 <= took < 1.5
    outcome, took = asyncio.run(ends(Session(idle=0.3, longest=0.8), busy=True))  # traffic does not extend it
    assert outcome == SessionOutcome.MAX_LENGTH and 0.8 <= took < 2.0


def test_who_may_enter_is_decided_once_from_the_key_and_the_task():
    from apps.core.principals import Principal, PrincipalKind
    from apps.tenants import services as tenants
    from apps.tenants.choices import Role
    from apps.tunnel.entry import Denied
    from apps.tunnel.entry import authorize_bearer as authorize
    from tests.factories import UserFactory, make_group, make_task

    node = make_node("n1")
    lab, other = tenants.create_tenant(name="Lab", slug="lab"), tenants.create_tenant(name="Other", slug="other")
    keys_ = {}
    for tenant, name, role in ((lab, "alice", Role.ADMIN), (lab, "vera", Role.VIEWER), (other, "olga", Role.MEMBER)):
        user = UserFactory(username=name)
        tenants.add_member(tenant, username=name, role=role)
        owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=role)
        keys_[name] = tenants.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="k").key
    group = make_group(lab, workers=2, members=lambda rank: {"status": "running", "node": node})
    rank0, rank1 = group.tasks.order_by("rank")
    stopped = make_task(lab, status="stopped", node=node)

    def denied(key, task_id, rank=None):
        with pytest.raises(Denied) as caught:
            authorize(key, task_id, rank)
        return caught.value.status, caught.value.body["error"]["code"]

    entry = authorize(keys_["alice"], rank0.pk, 1)  # the group's rank 1, reached from rank 0
    assert (entry.task_id, entry.node_id) == (rank1.pk, "n1")
    assert entry.who["principal"] == "alice (admin of lab, key k)" and entry.who["tenant_id"] == lab.pk
    assert denied(keys_["alice"], rank0.pk, 5) == (404, "not_found")
    assert denied(keys_["alice"], stopped.pk, 0) == (400, "invalid")  # not a group's member
    assert denied(keys_["alice"], stopped.pk) == (409, "task_not_running")
    assert denied(keys_["olga"], rank0.pk) == (404, "not_found")
    assert denied(keys_["vera"], rank0.pk) == (403, "permission_denied")
    assert denied("sk-tenant-nobody", rank0.pk) == (401, "authentication_failed")


def test_a_terminal_ticket_admits_its_person_to_its_task_once():
    """The portal terminal's way in (apps.tunnel.entry): a ticket names the person, their
    tenant and the task; it is refused for another task, after TICKET_SECONDS, a second
    time, forged, and once the person is deactivated or no longer a member."""
    from apps.core.principals import Principal, PrincipalKind
    from apps.tenants import services as tenants
    from apps.tenants.choices import Role
    from apps.tenants.models import Membership
    from apps.tunnel.api.routes import TunnelUserApp
    from apps.tunnel.entry import TICKET_SECONDS, Denied, issue_ticket
    from tests.factories import UserFactory, make_task

    node = make_node("n1")
    lab = tenants.create_tenant(name="Lab", slug="lab")
    alice = UserFactory(username="alice")
    tenants.add_member(lab, username="alice", role=Role.MEMBER)
    principal = Principal(PrincipalKind.TENANT_USER, user=alice, tenant=lab, role=Role.MEMBER)
    task, other = (make_task(lab, status="running", node=node) for _ in range(2))
    route = TunnelUserApp(None)

    def enter(ticket, task_id=task.pk):
        return asyncio.run(route.authorize("", ticket, task_id, None))

    def refused(ticket, task_id=task.pk):
        with pytest.raises(Denied) as caught:
            enter(ticket, task_id)
        return caught.value.status, caught.value.body["error"]["message"]

    ticket = issue_ticket(principal, task.pk)
    admitted = enter(ticket)
    assert (admitted.task_id, admitted.who["principal"]) == (task.pk, "alice (member of lab, in the portal)")
    assert refused(ticket) == (401, "This terminal ticket was used already.")
    assert refused(issue_ticket(principal, task.pk), other.pk) == (401, "This ticket is for another task.")
    assert refused(ticket[:-2] + "xx") == (401, "Not a valid terminal ticket.")
    stale = issue_ticket(principal, task.pk)
    with time_machine.travel(time.time() + TICKET_SECONDS + 1):
        assert refused(stale) == (401, "The ticket expired; ask for another.")
    Membership.objects.filter(user=alice).delete()
    assert refused(issue_ticket(principal, task.pk))[0] == 404  # no longer sees the task
    alice.is_active = False
    alice.save(update_fields=["is_active"])
    assert refused(issue_ticket(principal, task.pk)) == (401, "The ticket's user can no longer sign in.")
