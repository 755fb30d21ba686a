from django.apps import AppConfig


class TunnelConfig(AppConfig):
    name = "apps.tunnel"
    label = "tunnel"
    verbose_name = "Tunnel"
