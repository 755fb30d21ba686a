from django.urls import path

from apps.nodes.api import gpu_health, images, install_views, views

urlpatterns = [
    path("agent/auth-check", views.AgentAuthCheckView.as_view(), name="agent-auth-check"),
    # Agent installation (docs/agent-install.md): scripts and wheels served to the nodes.
    path("agent/install.sh", install_views.install_script, name="agent-install-script"),
    path("agent/update-agent-quick.sh", install_views.update_quick_script, name="agent-update-quick-script"),
    path("agent/update-agent-force.sh", install_views.update_force_script, name="agent-update-force-script"),
    path("agent/dist/<str:arch>/", install_views.dist_index, name="agent-dist-index"),
    path("agent/dist/<str:arch>/<str:filename>", install_views.dist_file, name="agent-dist-file"),
    path("nodes", views.NodeListView.as_view(), name="node-list"),
    path("nodes/metrics/<str:node_id>", views.NodeMetricsView.as_view(), name="node-metrics"),
    path("nodes/<str:node_id>", views.NodeDetailView.as_view(), name="node-detail"),
    path("nodes/<str:node_id>/energy", views.NodeEnergyView.as_view(), name="node-energy"),
    path("nodes/<str:node_id>/gpus/<int:index>", views.NodeGpuView.as_view(), name="node-gpu"),
    # card health (docs/gpu-health.md)
    path("gpu-health", gpu_health.GpuHealthListView.as_view(), name="gpu-health-list"),
    path("gpu-health/predictions", gpu_health.GpuHealthPredictionsView.as_view(), name="gpu-health-predictions"),
    path("gpu-health/capabilities", gpu_health.GpuHealthCapabilitiesView.as_view(), name="gpu-health-capabilities"),
    path("nodes/<str:node_id>/gpus/<int:index>/health", gpu_health.CardHealthView.as_view(), name="node-gpu-health"),
    path(
        "admin/nodes/<str:node_id>/gpus/<int:index>/cordon",
        gpu_health.CardCordonView.as_view(),
        name="node-gpu-cordon",
    ),
    path(
        "admin/nodes/<str:node_id>/gpus/<int:index>/uncordon",
        gpu_health.CardUncordonView.as_view(),
        name="node-gpu-uncordon",
    ),
    path("admin/nodes/<str:node_id>/location", views.NodeLocationView.as_view(), name="node-location"),
    path("admin/nodes/<str:node_id>/energy", views.NodeEnergySettingsView.as_view(), name="node-energy-settings"),
    # carbon (docs/energy.md#carbon)
    path("admin/emission-factors", views.EmissionFactorListView.as_view(), name="emission-factor-list"),
    path("admin/emission-factors/<str:region>", views.EmissionFactorDetailView.as_view(), name="emission-factor"),
    path("admin/nodes/<str:node_id>/tenant", views.NodeTenantView.as_view(), name="node-tenant"),
    # out of service and back (docs/nodes.md#out-of-service)
    path("admin/nodes/<str:node_id>/drain", views.NodeServiceView.as_view(move="drain"), name="node-drain"),
    path(
        "admin/nodes/<str:node_id>/maintenance",
        views.NodeServiceView.as_view(move="maintenance"),
        name="node-maintenance",
    ),
    path("admin/nodes/<str:node_id>/return", views.NodeServiceView.as_view(move="return"), name="node-return"),
    path("environment/summary", views.EnvironmentSummaryView.as_view(), name="environment-summary"),
    # the image channel (docs/images.md)
    path("nodes/<str:node_id>/images/pull", images.NodeImagePullView.as_view(), name="node-images-pull"),
    path("nodes/<str:node_id>/images/check", images.NodeImageCheckView.as_view(), name="node-images-check"),
    path("nodes/<str:node_id>/images/watched", images.NodeWatchedImagesView.as_view(), name="node-images-watched"),
    path("image-requests", images.ImageRequestListView.as_view(), name="image-request-list"),
    path("image-requests/<int:pk>", images.ImageRequestDetailView.as_view(), name="image-request-detail"),
    path("watched-images", images.WatchedImageListView.as_view(), name="watched-image-list"),
    path("watched-images/<int:pk>", images.WatchedImageDetailView.as_view(), name="watched-image-detail"),
    path("agent/image-requests", images.AgentImageRequestListView.as_view(), name="agent-image-request-list"),
    path("agent/image-requests/<int:pk>", images.AgentImageRequestView.as_view(), name="agent-image-request"),
]
