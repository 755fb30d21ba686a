"""The dashboard and the tenant switcher. The other pages are in apps/portal/pages/."""

from django.http import Http404
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from apps.alerts.selectors import alert_stats
from apps.core.authentication import SESSION_TENANT_KEY
from apps.nodes.selectors import environment_summary, gpu_summary, node_list
from apps.portal.access import portal_page
from apps.portal.pages import server
from apps.tasks.selectors import task_stats
from apps.tasks.services import quota_use

NODES_ON_HOME = 20


@portal_page
def home(request):
    principal = request.principal
    nodes = list(node_list(principal).order_by("name", "id")[: NODES_ON_HOME + 1])
    quota = None
    if principal.is_tenant:
        quota = {"tenant": principal.tenant, "use": quota_use(principal.tenant)}
    # the server monitoring panel: operators only, and only then are its reads made
    panel = server.panel_context(request) if principal.is_operator else None
    return render(
        request,
        "portal/home.html",
        {
            "cluster": environment_summary(principal),
            "gpus": gpu_summary(principal),
            "tasks": task_stats(principal),
            "alerts": alert_stats(principal),
            "quota": quota,
            "nodes": nodes[:NODES_ON_HOME],
            "more_nodes": len(nodes) > NODES_ON_HOME,
            "server_panel": panel,
        },
        status=400 if panel and panel.get("error") else 200,
    )


@require_POST
@portal_page
def switch_tenant(request):
    slug = request.POST.get("tenant", "")
    if not request.user.memberships.filter(tenant__slug=slug).exists():
        raise Http404("No such tenant among yours.")
    request.session[SESSION_TENANT_KEY] = slug
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(target, {request.get_host()}, request.is_secure()):
        return redirect(target)
    return redirect("portal:home")
