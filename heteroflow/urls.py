from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.monitoring import views as monitoring

api_v1 = [
    path("", include("apps.tenants.api.urls")),
    path("", include("apps.nodes.api.urls")),
]

urlpatterns = [
    path("", RedirectView.as_view(url="/portal/", permanent=False)),
    path("health", monitoring.health, name="health"),
    path("health/detail", monitoring.health_detail, name="health-detail"),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("admin/", admin.site.urls),
    path("portal/", include("apps.portal.urls")),
]

handler404 = "apps.core.errors.not_found"
handler500 = "apps.core.errors.server_error"
