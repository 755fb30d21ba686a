from django.urls import path

from apps.gateway.api import views

urlpatterns = [
    path("gateway/keys", views.EndpointKeyListView.as_view(), name="endpoint-key-list"),
    path("gateway/keys/<int:pk>", views.EndpointKeyDetailView.as_view(), name="endpoint-key-detail"),
    path("gateway/keys/<int:pk>/rotate", views.EndpointKeyRotateView.as_view(), name="endpoint-key-rotate"),
    path("gateway/usage", views.UsageView.as_view(), name="gateway-usage"),
    path("gateway/backends", views.ExternalBackendListView.as_view(), name="gateway-backend-list"),
    path("gateway/backends/<int:pk>", views.ExternalBackendDetailView.as_view(), name="gateway-backend-detail"),
    path("gateway/routes/<int:pk>", views.ServiceRouteView.as_view(), name="gateway-route"),
]
