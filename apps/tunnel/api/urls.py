from django.urls import path

from apps.tunnel.api import views

urlpatterns = [
    path("tasks/<int:pk>/app", views.TaskAppView.as_view(), name="task-app"),
]
