"""The portal's sign-in page: Django's LoginView, answering 429 with Retry-After while
the username is locked out from this address (apps.core.login_limits)."""

from __future__ import annotations

from django.contrib.auth import views as auth_views

from apps.core.login_limits import client_ip, refused


class LoginView(auth_views.LoginView):
    template_name = "portal/login.html"
    redirect_authenticated_user = True

    def post(self, request, *args, **kwargs):
        lock = refused(request.POST.get("username") or "", client_ip(request))
        if lock is not None:
            return self._locked(lock)
        response = super().post(request, *args, **kwargs)
        # the failure that was one too many, or a try refused by the lock-out backend
        lock = getattr(request, "heteroflow_login_lock", None)
        return self._locked(lock) if lock is not None else response

    def _locked(self, lock):
        form = self.get_form_class()(self.request)  # empty: nothing of the try is shown again
        response = self.render_to_response(self.get_context_data(form=form, locked_for=lock.retry_after))
        response.status_code = 429
        response["Retry-After"] = str(lock.retry_after)
        return response
