from django.urls import path

from apps.slices.api import views

urlpatterns = [
    path("slices", views.SliceListView.as_view(), name="slice-list"),
    path("slices/<int:pk>", views.SliceDetailView.as_view(), name="slice-detail"),
    path("agent/slice-requests", views.AgentSliceRequestListView.as_view(), name="agent-slice-request-list"),
    path(
        "agent/slice-requests/<int:pk>", views.AgentSliceRequestDetailView.as_view(), name="agent-slice-request-detail"
    ),
]
