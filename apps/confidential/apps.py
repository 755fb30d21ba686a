from django.apps import AppConfig


class ConfidentialConfig(AppConfig):
    name = "apps.confidential"
    label = "confidential"
