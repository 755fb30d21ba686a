from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "apps.inference"
    label = "inference"

    def ready(self):
        from apps.inference import lending, services
        from apps.nodes import services as node_services
        from apps.scheduler import lending as scheduler_lending

        # the models registered on a node: a pre-check of its deletion (apps.nodes never imports this app)
        node_services.register_deletion_check(services.clear_models_on)
        # training borrows idle replicas' cards: the cycle asks this app (apps.scheduler never imports it)
        scheduler_lending.register_lender(scheduler_lending.Lender(offer=lending.offer, lend=lending.lend))
