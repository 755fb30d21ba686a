"""Query decoding (strict) and the documented shapes of the monitoring answers."""

from rest_framework import serializers

from apps.core.serializers import StrictSerializer
from apps.monitoring.selectors import HISTORY_MAX_HOURS, HISTORY_MIN_HOURS


class HistoryQuerySerializer(StrictSerializer):
    hours = serializers.IntegerField(
        min_value=HISTORY_MIN_HOURS,
        max_value=HISTORY_MAX_HOURS,
        default=1,
        help_text="1..168. Buckets: up to 1 h per minute, 6 h per 5 min, 24 h per 15 min, 168 h per hour.",
    )
    host = serializers.CharField(max_length=255, required=False, default="", help_text="Only this host's series.")


class HostReadingSerializer(serializers.Serializer):
    cpu_percent = serializers.FloatField(allow_null=True)
    memory_percent = serializers.FloatField(allow_null=True)
    memory_used_bytes = serializers.IntegerField(allow_null=True)
    memory_total_bytes = serializers.IntegerField(allow_null=True)
    disk_percent = serializers.FloatField(allow_null=True, help_text="The root file system.")
    disk_used_bytes = serializers.IntegerField(allow_null=True)
    disk_total_bytes = serializers.IntegerField(allow_null=True)
    load_1 = serializers.FloatField(allow_null=True)
    load_5 = serializers.FloatField(allow_null=True)
    load_15 = serializers.FloatField(allow_null=True)
    net_recv_bytes = serializers.IntegerField(allow_null=True, help_text="Counter since the host booted.")
    net_sent_bytes = serializers.IntegerField(allow_null=True, help_text="Counter since the host booted.")
    net_recv_bytes_per_second = serializers.FloatField(allow_null=True)
    net_sent_bytes_per_second = serializers.FloatField(allow_null=True)
    cpu_temperature_celsius = serializers.FloatField(allow_null=True, help_text="null: the host has no CPU sensor.")


class LiveMetricsSerializer(HostReadingSerializer):
    host = serializers.CharField()
    at = serializers.DateTimeField()
    os = serializers.CharField()
    arch = serializers.CharField()
    python = serializers.CharField()
    uptime_seconds = serializers.IntegerField(allow_null=True)
    cpu_window_seconds = serializers.FloatField(help_text="The time the CPU figure covers.")
    net_rate_since = serializers.DateTimeField(
        allow_null=True, help_text="The stored sample the rates are measured from."
    )


class HistoryPointSerializer(HostReadingSerializer):
    at = serializers.DateTimeField(help_text="Start of the bucket.")
    samples = serializers.IntegerField()
    cpu_temperature_max_celsius = serializers.FloatField(allow_null=True)


class HostSeriesSerializer(serializers.Serializer):
    host = serializers.CharField()
    points = HistoryPointSerializer(many=True)


class HistorySerializer(serializers.Serializer):
    hours = serializers.IntegerField()
    bucket_seconds = serializers.IntegerField()
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    hosts = HostSeriesSerializer(many=True)


class CheckSerializer(serializers.Serializer):
    name = serializers.ChoiceField(choices=["database", "storage", "scheduler", "gpu_nodes", "broker", "configuration"])
    status = serializers.ChoiceField(choices=["ok", "warning", "error"])
    message = serializers.CharField()
    suggestion = serializers.CharField(allow_blank=True)
    details = serializers.DictField()


class HealthCheckSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=["healthy", "degraded", "unhealthy"])
    checked_at = serializers.DateTimeField()
    checks = CheckSerializer(many=True)


class HealthDetailSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=["ok", "degraded", "unhealthy"])
    checks = serializers.DictField(
        help_text="database, scheduler, gpu_resources (of the nodes you may see), tasks (yours), plugins (operators only)."
    )


class RuntimeSerializer(serializers.Serializer):
    pid = serializers.IntegerField()
    uptime_seconds = serializers.FloatField()
    python = serializers.DictField()
    memory = serializers.DictField()
    threads = serializers.DictField()
    gc = serializers.DictField()
    database_pool = serializers.DictField(allow_null=True)
    heartbeat_pool = serializers.DictField(allow_null=True)
    metrics = serializers.DictField()
