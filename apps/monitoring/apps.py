from django.apps import AppConfig


class MonitoringConfig(AppConfig):
    name = "apps.monitoring"
    label = "monitoring"

    def ready(self):
        from celery import signals

        from apps.monitoring import processes

        signals.before_task_publish.connect(processes.count_published, weak=False, dispatch_uid="heteroflow-published")
