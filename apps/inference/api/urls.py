from django.urls import path

from apps.inference.api import views

urlpatterns = [
    path("models", views.ModelListView.as_view(), name="model-list"),
    path("models/<int:pk>", views.ModelDetailView.as_view(), name="model-detail"),
]
