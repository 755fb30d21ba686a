from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("core", "0002_operator_audit_events"),
    ]

    operations = [
        migrations.AddField(
            model_name="jobrun",
            name="total_seconds",
            field=models.FloatField(default=0.0, db_default=0.0),
        ),
        migrations.AddField(
            model_name="jobrun",
            name="max_seconds",
            field=models.FloatField(default=0.0, db_default=0.0),
        ),
    ]
