from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "apps.inference"
    label = "inference"
