from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0012_task_groups"),
    ]

    operations = [
        migrations.AddField(
            model_name="taskgroup",
            name="ended_attempt",
            field=models.PositiveIntegerField(default=0, help_text="the last attempt a lost worker ended"),
        ),
    ]
