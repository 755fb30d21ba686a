import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("nodes", "0015_beat_write_cost"),
        ("tenants", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="TunnelHostKey",
            fields=[
                (
                    "node",
                    models.OneToOneField(
                        db_column="node_id",
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="tunnel_key",
                        serialize=False,
                        to="nodes.node",
                    ),
                ),
                ("public_key", models.TextField(help_text="OpenSSH form: ssh-ed25519 AAAA…")),
                ("fingerprint", models.CharField(max_length=100, unique=True)),
                ("pinned_at", models.DateTimeField()),
                ("last_connected_at", models.DateTimeField(blank=True, null=True)),
                (
                    "last_instance",
                    models.CharField(blank=True, default="", help_text="the tunnel process it last used", max_length=200),
                ),
            ],
            options={"db_table": "tunnel_host_keys"},
        ),
        migrations.CreateModel(
            name="TunnelSession",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("task_id", models.BigIntegerField(db_index=True)),
                ("node_id", models.CharField(max_length=128)),
                ("principal", models.CharField(help_text="who, in words (user, role, key)", max_length=300)),
                ("kind", models.CharField(choices=[("port", "Port"), ("exec", "Exec")], max_length=10)),
                ("port", models.PositiveIntegerField(blank=True, null=True)),
                ("command", models.TextField(blank=True, default="")),
                ("started_at", models.DateTimeField(db_index=True)),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                ("bytes_in", models.BigIntegerField(default=0, help_text="from the user to the task")),
                ("bytes_out", models.BigIntegerField(default=0, help_text="from the task to the user")),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("open", "Open"),
                            ("closed", "Closed"),
                            ("refused", "Refused"),
                            ("idle", "Idle"),
                            ("max_length", "Max Length"),
                            ("lost", "Lost"),
                            ("unreachable", "Unreachable"),
                        ],
                        default="open",
                        max_length=20,
                    ),
                ),
                ("reason", models.TextField(blank=True, default="")),
                ("instance", models.CharField(blank=True, default="", max_length=200)),
                (
                    "tenant",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="tenants.tenant",
                    ),
                ),
                (
                    "user",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={"db_table": "tunnel_sessions", "ordering": ("-started_at",)},
        ),
    ]
