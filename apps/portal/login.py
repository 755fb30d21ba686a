"""The portal's (and the admin's) sign-in page: Django's LoginView, answering 429 with
Retry-After while the username is locked out from this address (apps.core.login_limits);
a button for each OpenID provider beside the form (apps.identity), the form folded away
for break-glass operators when HETEROFLOW_LOCAL_SIGN_IN is off and no LDAP directory
takes it. Signing out also signs out of the provider the session came from."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import logout
from django.contrib.auth import views as auth_views
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_POST

from apps.core.login_limits import client_ip, refused
from apps.identity import oidc
from apps.identity.services import REFUSAL_ATTRIBUTE
from apps.identity.views import SESSION_LOGOUT_HINT, SESSION_PROVIDER, provider_logout_url, refusal


class LoginView(auth_views.LoginView):
    template_name = "portal/login.html"
    redirect_authenticated_user = True

    def dispatch(self, request, *args, **kwargs):
        # ?reauth=1 asks a signed-in person again (before an API key is created:
        # HETEROFLOW_REAUTH_SECONDS), so it must not send them straight back
        self.reauth = bool(request.GET.get("reauth") or request.POST.get("reauth"))
        if self.reauth:
            self.redirect_authenticated_user = False
        return super().dispatch(request, *args, **kwargs)

    def post(self, request, *args, **kwargs):
        lock = refused(request.POST.get("username") or "", client_ip(request))
        if lock is not None:
            return self._locked(lock)
        response = super().post(request, *args, **kwargs)
        # the failure that was one too many, or a try refused by the lock-out backend
        lock = getattr(request, "heteroflow_login_lock", None)
        if lock is not None:
            return self._locked(lock)
        # the directory knew the person, and the mappings give them nothing
        reason = getattr(request, REFUSAL_ATTRIBUTE, None)
        if reason is not None:
            return refusal(request, "You cannot sign in to HeteroFlow", reason, 403)
        return response

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        next_url = context.get("next") or ""
        params = {"next": next_url} if next_url else {}
        if self.reauth:
            params["reauth"] = 1
        query = f"?{urlencode(params)}" if params else ""
        context["reauth"] = self.reauth
        context["providers"] = [
            {"label": provider.label, "url": reverse("identity:oidc-start", args=[provider.name]) + query}
            for provider in oidc.providers()
        ]
        ldap = bool(getattr(settings, "HETEROFLOW_LDAP_SERVER_URI", ""))
        context["form_folded"] = not settings.HETEROFLOW_LOCAL_SIGN_IN and not ldap
        context["ldap"] = ldap
        return context

    def _locked(self, lock):
        form = self.get_form_class()(self.request)  # empty: nothing of the try is shown again
        response = self.render_to_response(self.get_context_data(form=form, locked_for=lock.retry_after))
        response.status_code = 429
        response["Retry-After"] = str(lock.retry_after)
        return response


@require_POST
def logout_view(request):
    """Signs the session out; one that came from an OpenID provider goes on to the
    provider's end_session_endpoint (RP-initiated logout), which sends it back here."""
    name, id_token = request.session.get(SESSION_PROVIDER), request.session.get(SESSION_LOGOUT_HINT)
    logout(request)
    provider_url = provider_logout_url(request, name, id_token)
    if provider_url is None:
        return redirect(settings.LOGOUT_REDIRECT_URL)
    # a page that goes on by itself, not a redirect: the CSP's form-action 'self' would
    # stop a form's redirect to another origin
    return render(request, "portal/signed_out.html", {"provider_url": provider_url})


def admin_login(request, extra_context=None):
    """The admin's sign-in: a GET shows the portal's page (its providers' buttons beside the
    form, or the form folded away), which brings the person back to the admin; a POST is
    the admin's own form, as before (its lock-out included)."""
    if request.method == "GET":
        target = request.GET.get("next") or reverse("admin:index")
        return redirect(f"{reverse('portal:login')}?{urlencode({'next': target})}")
    return admin.site.login(request, extra_context)
