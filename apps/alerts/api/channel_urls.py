from django.urls import path

from apps.alerts.api import channel_views as views

urlpatterns = [
    path("alerts/channels", views.ChannelListView.as_view(), name="alert-channel-list"),
    path("alerts/channels/<int:pk>", views.ChannelDetailView.as_view(), name="alert-channel-detail"),
    path("alerts/channels/<int:pk>/test", views.ChannelTestView.as_view(), name="alert-channel-test"),
    path(
        "alerts/channels/<int:pk>/rotate-secret",
        views.ChannelRotateSecretView.as_view(),
        name="alert-channel-rotate-secret",
    ),
    path(
        "alerts/channels/<int:pk>/deliveries", views.ChannelDeliveryListView.as_view(), name="alert-channel-deliveries"
    ),
]
