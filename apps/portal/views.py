from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from apps.core.authentication import SESSION_TENANT_KEY, principal_for_session
from apps.tenants.models import Membership


@login_required
def home(request):
    principal = principal_for_session(request, request.user)
    memberships = Membership.objects.filter(user=request.user).select_related("tenant").order_by("tenant__name")
    return render(request, "portal/home.html", {"principal": principal, "memberships": memberships})


@login_required
@require_POST
def switch_tenant(request):
    slug = request.POST.get("tenant", "")
    if not Membership.objects.filter(user=request.user, tenant__slug=slug).exists():
        raise Http404("No such tenant among yours.")
    request.session[SESSION_TENANT_KEY] = slug
    return redirect("portal:home")
