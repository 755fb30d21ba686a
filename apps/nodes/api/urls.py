from django.urls import path

from apps.nodes.api import views

urlpatterns = [
    path("agent/auth-check", views.AgentAuthCheckView.as_view(), name="agent-auth-check"),
]
