from django.db import models


class ServerMetric(models.Model):
    """One sample of a control-plane host, every 30 s per host. `host` keeps several
    instances apart, so each has its own curve. A reading the host does not offer (no
    temperature sensor, no previous sample for a rate) is null, never 0."""

    id = models.BigAutoField(primary_key=True)
    host = models.CharField(max_length=255)
    at = models.DateTimeField()
    cpu_percent = models.FloatField(null=True)
    memory_percent = models.FloatField(null=True)
    memory_used_bytes = models.BigIntegerField(null=True)
    memory_total_bytes = models.BigIntegerField(null=True)
    disk_percent = models.FloatField(null=True)
    disk_used_bytes = models.BigIntegerField(null=True)
    disk_total_bytes = models.BigIntegerField(null=True)
    load_1 = models.FloatField(null=True)
    load_5 = models.FloatField(null=True)
    load_15 = models.FloatField(null=True)
    # counters since the host booted, and the rate since this host's previous sample
    net_recv_bytes = models.BigIntegerField(null=True)
    net_sent_bytes = models.BigIntegerField(null=True)
    net_recv_bytes_per_second = models.FloatField(null=True)
    net_sent_bytes_per_second = models.FloatField(null=True)
    uptime_seconds = models.BigIntegerField(null=True)
    cpu_temperature_celsius = models.FloatField(null=True)

    class Meta:
        db_table = "server_metrics"
        indexes = [
            models.Index(fields=["host", "-at"], name="server_metrics_host_at"),
            models.Index(fields=["at"], name="server_metrics_at"),  # retention
        ]

    def __str__(self):
        return f"{self.host} @ {self.at:%Y-%m-%d %H:%M:%S}"
