from django.urls import path

from apps.tenants.api import views

urlpatterns = [
    path("me", views.MeView.as_view(), name="me"),
    path("tenants", views.TenantListView.as_view(), name="tenant-list"),
    path("tenants/<slug:slug>", views.TenantDetailView.as_view(), name="tenant-detail"),
    path("tenants/<slug:slug>/members", views.MemberListView.as_view(), name="member-list"),
    path("tenants/<slug:slug>/members/<str:username>", views.MemberDetailView.as_view(), name="member-detail"),
    path("tenants/<slug:slug>/audit", views.AuditLogView.as_view(), name="tenant-audit"),
    path("admin/audit", views.OperatorAuditLogView.as_view(), name="operator-audit"),
    path("tenant-groups", views.TenantGroupListView.as_view(), name="tenant-group-list"),
    path("tenant-groups/<int:pk>", views.TenantGroupDetailView.as_view(), name="tenant-group-detail"),
    path("api-keys", views.ApiKeyListView.as_view(), name="api-key-list"),
    path("api-keys/<int:pk>", views.ApiKeyDetailView.as_view(), name="api-key-detail"),
]
