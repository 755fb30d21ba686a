from django.apps import AppConfig


class SlicesConfig(AppConfig):
    name = "apps.slices"
    label = "slices"
