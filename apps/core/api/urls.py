from django.urls import path

from apps.core.api import schemas

urlpatterns = [
    path("schemas/jobs", schemas.JobsSchemaView.as_view(), name="jobs-schema"),
]
