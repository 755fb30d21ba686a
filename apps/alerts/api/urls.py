from django.urls import path

from apps.alerts.api import views

urlpatterns = [
    path("alerts", views.AlertListView.as_view(), name="alert-list"),
    path("alerts/stats", views.AlertStatsView.as_view(), name="alert-stats"),
    path("alerts/<int:pk>", views.AlertDetailView.as_view(), name="alert-detail"),
    path("alerts/<int:pk>/acknowledge", views.AlertAcknowledgeView.as_view(), name="alert-acknowledge"),
    path("alerts/<int:pk>/resolve", views.AlertResolveView.as_view(), name="alert-resolve"),
]
