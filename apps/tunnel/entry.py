"""Who may enter a running task through the tunnel (docs/tunnel.md#who-may-enter), checked
once when a session starts, and the two ways a session says who it is:

- an API key (`Authorization: Bearer`), as `hf` does;
- a terminal ticket, as the portal's terminal page does: a browser cannot set a
  WebSocket's headers, and a session cookie on a WebSocket would let any site that the
  person visits open one in their name (a WebSocket is not bound by the same-origin
  rule). The page asks for a ticket with a CSRF-checked POST under its session, where the
  session's own rules (its idle time-out) apply; the ticket names the person, the tenant
  they work in and the task, is signed with SECRET_KEY, lasts TICKET_SECONDS and is
  good for one session (its nonce is claimed in Redis when it is redeemed).

Both end in `admit`: the task visible to the principal (404), a member or admin of its
tenant or an operator (403), running (409). Everything here is synchronous ORM work, run
in a thread by the route."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.core import signing
from django.db import connection
from rest_framework import exceptions

from apps.core.authentication import authenticate_bearer, principal_for_user
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import error_body
from apps.core.throttling import check_principal
from apps.tasks.choices import TaskStatus
from apps.tasks.models import Task
from apps.tenants import policy
from apps.tunnel.error_codes import TunnelErrorCode

TICKET_SALT = "heteroflow.tunnel.ticket"
TICKET_SECONDS = 30
TICKET_NONCE_KEY = "heteroflow:tunnel:ticket:{}"  # claimed once (SET NX), kept past the ticket's life


class Denied(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.body = status, error_body(code, message)


@dataclass(frozen=True)
class Entry:
    task_id: int
    node_id: str
    who: dict


def describe(principal) -> str:
    """Who, in words, for the audit."""
    user = getattr(principal.user, "username", "") or "?"
    if principal.is_operator:
        return f"{user} (operator)"
    if principal.api_key is not None:
        through = f", key {principal.api_key.name}"
    elif principal.tenant is not None:
        through = ", in the portal"
    else:
        through = ""
    return f"{user} ({principal.role} of {principal.tenant.slug}{through})"


def admit(principal, task_id: int, rank: int | None = None) -> Entry:
    """The running task `task_id` (or its group's member of `rank`) if `principal` may
    enter it. Raises Denied."""
    visible = Task.objects.visible_to(principal)
    task = visible.filter(pk=task_id).select_related("tenant").first()
    if task is None:
        raise Denied(404, CoreErrorCode.NOT_FOUND, "Not found.")
    if rank is not None:
        if task.group_id is None:
            raise Denied(400, CoreErrorCode.INVALID, "rank: this task is not a member of a group.")
        task = visible.filter(group_id=task.group_id, rank=rank).select_related("tenant").order_by("-pk").first()
        if task is None:
            raise Denied(404, CoreErrorCode.NOT_FOUND, f"The group has no member of rank {rank}.")
    if not policy.may_enter_task(principal, task):
        raise Denied(403, CoreErrorCode.PERMISSION_DENIED, "Only the tenant's members and admins may enter a task.")
    if task.status != TaskStatus.RUNNING or not task.node_id:
        raise Denied(409, TunnelErrorCode.TASK_NOT_RUNNING, f"Task {task.pk} is {task.status}, not running.")
    user_id = getattr(principal.user, "pk", None)
    who = {"principal": describe(principal), "user_id": user_id, "tenant_id": task.tenant_id}
    return Entry(task.pk, task.node_id, who)


def authorize_bearer(token: str, task_id: int, rank: int | None) -> Entry:
    """A session that came with an API key. Raises Denied."""
    try:
        try:
            _, principal = authenticate_bearer(token)
            check_principal(principal)  # the API's rate limit (HETEROFLOW_API_RATE), as for any request
        except exceptions.AuthenticationFailed as failed:
            raise Denied(401, CoreErrorCode.AUTHENTICATION_FAILED, str(failed.detail)) from None
        except exceptions.Throttled as throttled:
            raise Denied(429, CoreErrorCode.THROTTLED, str(throttled.detail)) from None
        return admit(principal, task_id, rank)
    finally:
        connection.close()


def issue_ticket(principal, task_id: int) -> str:
    """A ticket for one session into `task_id` in the principal's name (a person signed in
    to the portal). The caller has admitted them."""
    tenant = principal.tenant.slug if principal.tenant is not None else None
    body = {"u": principal.user.pk, "t": tenant, "k": task_id, "n": secrets.token_urlsafe(12)}
    return signing.dumps(body, salt=TICKET_SALT)


def read_ticket(ticket: str, task_id: int) -> dict:
    """The ticket's body when it is genuine, not expired and for this task. Raises Denied."""
    try:
        body = signing.loads(ticket, salt=TICKET_SALT, max_age=TICKET_SECONDS)
    except signing.SignatureExpired:
        raise Denied(401, CoreErrorCode.AUTHENTICATION_FAILED, "The ticket expired; ask for another.") from None
    except signing.BadSignature:
        raise Denied(401, CoreErrorCode.AUTHENTICATION_FAILED, "Not a valid terminal ticket.") from None
    if not isinstance(body, dict) or body.get("k") != task_id:
        raise Denied(401, CoreErrorCode.AUTHENTICATION_FAILED, "This ticket is for another task.")
    return body


def ticket_principal(body: dict):
    """The person a ticket (or a pass made from one) names, as they are now, in the tenant
    they worked in. Raises Denied when they can no longer sign in."""
    user = get_user_model().objects.filter(pk=body.get("u"), is_active=True).first()
    if user is None:
        raise Denied(401, CoreErrorCode.AUTHENTICATION_FAILED, "The ticket's user can no longer sign in.")
    return principal_for_user(user, body.get("t"))


def authorize_ticket(body: dict, task_id: int, rank: int | None) -> Entry:
    """A session that came with a ticket (read and claimed): the person it names, as they
    are now (deactivated, or no longer a member: refused). Raises Denied."""
    try:
        return admit(ticket_principal(body), task_id, rank)
    finally:
        connection.close()
