from django.urls import path

from apps.scheduler.api import views

urlpatterns = [
    path("scheduler/plugins", views.PluginListView.as_view(), name="scheduler-plugins"),
    path("plugins/<str:name>", views.PluginView.as_view(), name="scheduler-plugin"),
    path("scheduler/dry-run", views.DryRunView.as_view(), name="scheduler-dry-run"),
]
