from django.urls import path

from apps.nodes.api import views

urlpatterns = [
    path("agent/auth-check", views.AgentAuthCheckView.as_view(), name="agent-auth-check"),
    path("nodes", views.NodeListView.as_view(), name="node-list"),
    path("nodes/metrics/<str:node_id>", views.NodeMetricsView.as_view(), name="node-metrics"),
    path("nodes/<str:node_id>", views.NodeDetailView.as_view(), name="node-detail"),
    path("nodes/<str:node_id>/energy", views.NodeEnergyView.as_view(), name="node-energy"),
    path("nodes/<str:node_id>/gpus/<int:index>", views.NodeGpuView.as_view(), name="node-gpu"),
    path("admin/nodes/<str:node_id>/location", views.NodeLocationView.as_view(), name="node-location"),
    path("admin/nodes/<str:node_id>/tenant", views.NodeTenantView.as_view(), name="node-tenant"),
    path("environment/summary", views.EnvironmentSummaryView.as_view(), name="environment-summary"),
]
