from django.db import models


class JobRun(models.Model):
    """The last run of one periodic job, shared by every beat, worker and instance."""

    key = models.CharField(max_length=100, primary_key=True)
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_outcome = models.CharField(max_length=20, blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    runs = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "job_runs"

    def __str__(self):
        return self.key
