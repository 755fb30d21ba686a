from django.contrib import admin
from django.urls import include, path, re_path
from django.views.decorators.csrf import csrf_exempt
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.core import errors
from apps.monitoring import views as monitoring
from apps.portal import login as portal_login

api_v1 = [
    path("", include("apps.tenants.api.urls")),
    path("", include("apps.nodes.api.urls")),
    path("", include("apps.tasks.api.urls")),
    path("", include("apps.tunnel.api.urls")),
    path("", include("apps.scheduler.api.urls")),
    path("", include("apps.inference.api.urls")),
    path("", include("apps.slices.api.urls")),
    path("", include("apps.gateway.api.urls")),
    # before any alerts/<...> route, so "channels" is never read as an alert's id
    path("", include("apps.alerts.api.channel_urls")),
    path("", include("apps.alerts.api.urls")),
    path("", include("apps.monitoring.api.urls")),
    path("", include("apps.core.api.urls")),
    path("", include("apps.identity.api.urls")),
]

urlpatterns = [
    path("", RedirectView.as_view(url="/portal/", permanent=False)),
    path("health", monitoring.health, name="health"),
    path("health/detail", monitoring.health_detail, name="health-detail"),
    path("metrics", monitoring.metrics, name="metrics"),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    # one sign-in page for the portal and the admin: the providers' buttons beside the form
    path("admin/login/", portal_login.admin_login, name="admin-login"),
    path("admin/", admin.site.urls),
    path("identity/", include("apps.identity.urls")),
    path("portal/", include("apps.portal.urls")),
    # API clients get the JSON 404 even when DEBUG shows HTML pages elsewhere, whatever
    # the method: exempt from CSRF (it writes nothing), or a POST to a path that does not
    # exist would get the HTML CSRF page (403) instead.
    re_path(r"^(api|v1)/", csrf_exempt(errors.not_found)),
]

handler404 = "apps.core.errors.not_found"
handler500 = "apps.core.errors.server_error"
