from django.contrib.auth import views as auth_views
from django.urls import path

from apps.portal import views

app_name = "portal"
urlpatterns = [
    path("", views.home, name="home"),
    path("login/", auth_views.LoginView.as_view(template_name="portal/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("tenant/", views.switch_tenant, name="switch-tenant"),
]
