from django.urls import path

from apps.identity import views

app_name = "identity"
urlpatterns = [
    path("oidc/<slug:name>/", views.oidc_start, name="oidc-start"),
    path("oidc/<slug:name>/callback", views.oidc_callback, name="oidc-callback"),
]
