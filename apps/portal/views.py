from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from apps.core.authentication import SESSION_TENANT_KEY, principal_for_session
from apps.nodes.selectors import node_list
from apps.tenants.models import Membership

NODES_ON_HOME = 50


@login_required
def home(request):
    principal = principal_for_session(request, request.user)
    memberships = Membership.objects.filter(user=request.user).select_related("tenant").order_by("tenant__name")
    nodes = node_list(principal).order_by("name", "id")[:NODES_ON_HOME] if principal else []
    return render(request, "portal/home.html", {"principal": principal, "memberships": memberships, "nodes": nodes})


@login_required
@require_POST
def switch_tenant(request):
    slug = request.POST.get("tenant", "")
    if not Membership.objects.filter(user=request.user, tenant__slug=slug).exists():
        raise Http404("No such tenant among yours.")
    request.session[SESSION_TENANT_KEY] = slug
    return redirect("portal:home")
