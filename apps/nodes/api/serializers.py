from rest_framework import serializers

from apps.core.serializers import StrictSerializer
from apps.nodes.choices import ExecMode, GpuVendor, NodeStatus
from apps.nodes.models import Gpu, Node


class GpuSerializer(serializers.ModelSerializer):
    state = serializers.CharField(read_only=True)

    class Meta:
        model = Gpu
        fields = [
            "index", "uuid", "vendor", "model", "memory_total_mb", "compute_capability", "state",
            "utilization", "memory_used_mb", "temperature", "power_w", "metrics_available", "lost_at", "lost_basis",
        ]


class NodeSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    gpu_used = serializers.IntegerField(read_only=True, help_text="GPUs held by active tasks.")
    gpus = GpuSerializer(many=True, read_only=True)
    gpus_lost = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id", "name", "tenant", "status", "ip", "internal_ip", "mac", "hostname", "os", "cpu_cores", "memory_gb",
            "is_container", "docker_available", "executable", "exec_mode", "error_message", "agent_version",
            "agent_git_commit", "agent_build_time", "heartbeat_interval", "cpu_used", "memory_used", "gpu_temperature",
            "gpu_memory_used_mb", "gpu_type", "gpu_model", "gpu_count", "gpu_used", "gpus_lost", "gpu_collector_error",
            "labels", "gpu_capabilities", "inference_engines", "inference_engine_versions", "vllm_available",
            "discovered_models", "task_health", "live_task_ids", "region", "zone", "rack", "version",
            "registered_at", "last_heartbeat_at", "gpus",
        ]

    def get_gpus_lost(self, node) -> int:
        return sum(1 for gpu in node.gpus.all() if gpu.lost_at is not None)


class NodeListQuerySerializer(StrictSerializer):
    limit = serializers.IntegerField(min_value=1, max_value=500, default=50)
    offset = serializers.IntegerField(min_value=0, default=0)
    q = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    status = serializers.ChoiceField(choices=NodeStatus.choices, required=False, allow_blank=True, default="")
    gpu_type = serializers.ChoiceField(choices=GpuVendor.choices, required=False, allow_blank=True, default="")


class NodeUpsertSerializer(StrictSerializer):
    id = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    name = serializers.CharField(max_length=200, required=False)
    ip = serializers.IPAddressField(required=False, allow_null=True)
    internal_ip = serializers.IPAddressField(required=False, allow_null=True)
    mac = serializers.RegexField(r"^([0-9A-Fa-f]{2}[:-]){5}[0-9A-Fa-f]{2}$", required=False, allow_blank=True)
    hostname = serializers.CharField(max_length=255, required=False, allow_blank=True)
    cpu_cores = serializers.IntegerField(min_value=1, max_value=4096, required=False, allow_null=True)
    memory_gb = serializers.FloatField(min_value=0, required=False, allow_null=True)
    exec_mode = serializers.ChoiceField(choices=ExecMode.choices, required=False)
    labels = serializers.DictField(child=serializers.CharField(max_length=1024), required=False)


class LocationSerializer(StrictSerializer):
    region = serializers.CharField(max_length=64, required=False, allow_blank=True)
    zone = serializers.CharField(max_length=64, required=False, allow_blank=True)
    rack = serializers.CharField(max_length=64, required=False, allow_blank=True)


class TenantAssignmentSerializer(StrictSerializer):
    tenant = serializers.CharField(allow_null=True, help_text="Tenant slug, or null for a shared node.")
    version = serializers.IntegerField(min_value=1, help_text="The node's version as you read it.")
    mode = serializers.ChoiceField(choices=[("drain", "drain"), ("evict", "evict")], default="drain")


class HoursSerializer(StrictSerializer):
    hours = serializers.IntegerField(min_value=1, max_value=168, default=1)
