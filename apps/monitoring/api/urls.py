from django.urls import path

from apps.monitoring.api import views

urlpatterns = [
    path("server/metrics", views.ServerMetricsView.as_view(), name="server-metrics"),
    path("server/metrics/history", views.ServerMetricsHistoryView.as_view(), name="server-metrics-history"),
    path("server/health-check", views.ServerHealthCheckView.as_view(), name="server-health-check"),
    path("server/runtime", views.ServerRuntimeView.as_view(), name="server-runtime"),
    path("health/detail", views.HealthDetailView.as_view(), name="api-health-detail"),
]
