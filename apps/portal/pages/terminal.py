"""Ways into a running task from the portal, through the tunnel:

- its terminal (docs/tunnel.md#the-portal-terminal): the page with xterm.js, and the
  ticket its script asks for, under the person's session and CSRF-checked, before each
  connection; the terminal speaks the exec WebSocket's frames (`/api/v1/tasks/{id}/exec`),
  as `hf ssh` does;
- an interactive task's app (docs/interactive.md#in-the-browser): *Open* sends the person
  to the app's proxy (`/apps/{id}/`) with a one-use ticket.

Who may enter is apps.tunnel.entry's decision, here and again where the ticket is used."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from apps.core.views import get_visible_or_404
from apps.portal.access import portal_page
from apps.tasks.choices import InteractiveApp, TaskKind
from apps.tasks.models import Task
from apps.tunnel import entry
from apps.tunnel.api.app_proxy import TICKET_PARAM, app_url


@portal_page
def terminal(request, pk):
    task = get_visible_or_404(Task.objects.select_related("tenant", "node"), request.principal, pk=pk)
    try:
        entry.admit(request.principal, task.pk)
    except entry.Denied as denied:
        refusal = denied.body["error"]["message"]
    else:
        refusal = ""
    response = render(request, "portal/terminal.html", {"task": task, "refusal": refusal})
    response["Content-Security-Policy"] = settings.HETEROFLOW_CSP_TERMINAL  # inline styles: xterm.js's
    return response


@require_POST
@portal_page
def terminal_ticket(request, pk):
    try:
        entry.admit(request.principal, pk)
    except entry.Denied as denied:
        return JsonResponse(denied.body, status=denied.status)
    return JsonResponse(
        {"ticket": entry.issue_ticket(request.principal, pk), "expires_in": entry.TICKET_SECONDS},
        headers={"Cache-Control": "no-store"},
    )


@portal_page
def task_open(request, pk):
    """An interactive task's app: to its proxy with a ticket, or back to the task's page
    with the reason."""
    task = get_visible_or_404(Task, request.principal, pk=pk)
    try:
        entry.admit(request.principal, task.pk)
    except entry.Denied as denied:
        messages.error(request, denied.body["error"]["message"])
        return redirect("portal:task", task.pk)
    if task.kind != TaskKind.INTERACTIVE or task.app != InteractiveApp.JUPYTER:
        messages.error(request, f"Task #{task.pk} has no app to open; its Terminal is a shell in it.")
        return redirect("portal:task", task.pk)
    if not settings.HETEROFLOW_APP_HOST:
        messages.error(request, f"Apps open in the browser once HETEROFLOW_APP_HOST is set; use hf open {task.pk}.")
        return redirect("portal:task", task.pk)
    ticket = entry.issue_ticket(request.principal, task.pk)
    return redirect(f"{app_url(task.pk, request.is_secure())}?{TICKET_PARAM}={ticket}")
