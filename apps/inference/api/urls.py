from django.urls import path

from apps.inference.api import views

urlpatterns = [
    path("models", views.ModelListView.as_view(), name="model-list"),
    path("models/<int:pk>", views.ModelDetailView.as_view(), name="model-detail"),
    path("inference-services", views.ServiceListView.as_view(), name="inference-service-list"),
    path("inference-services/<int:id>", views.ServiceDetailView.as_view(), name="inference-service-detail"),
    path("inference-services/<int:id>/scale", views.ServiceScaleView.as_view(), name="inference-service-scale"),
    path("inference-services/<int:id>/stop", views.ServiceStopView.as_view(), name="inference-service-stop"),
    path("inference-services/<int:id>/wake", views.ServiceWakeView.as_view(), name="inference-service-wake"),
    path(
        "inference-services/<int:id>/decisions",
        views.ServiceDecisionsView.as_view(),
        name="inference-service-decisions",
    ),
    path(
        "inference-replicas/<int:task_id>/model-ensure",
        views.ModelEnsureReportView.as_view(),
        name="inference-replica-model-ensure",
    ),
]
