from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("tasks", "0010_tenant_usage"),
    ]

    operations = [
        migrations.AddField(model_name="task", name="array_index", field=models.PositiveIntegerField(blank=True, null=True)),
        migrations.AddField(model_name="task", name="array_size", field=models.PositiveIntegerField(blank=True, null=True)),
    ]
