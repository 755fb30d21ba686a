from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "apps.inference"
    label = "inference"

    def ready(self):
        from apps.inference import services
        from apps.nodes import services as node_services

        # the models registered on a node: a pre-check of its deletion (apps.nodes never imports this app)
        node_services.register_deletion_check(services.clear_models_on)
