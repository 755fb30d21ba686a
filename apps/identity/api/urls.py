from django.urls import path

from apps.identity.api import views

urlpatterns = [
    path("admin/identity/mappings", views.MappingTableView.as_view(), name="identity-mappings"),
]
