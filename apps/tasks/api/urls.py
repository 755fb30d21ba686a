from django.urls import path

from apps.tasks.api import energy, views

urlpatterns = [
    path("tasks", views.TaskListView.as_view(), name="task-list"),
    path("tasks/batch", views.TaskBatchView.as_view(), name="task-batch"),
    path("tasks/stats", views.TaskStatsView.as_view(), name="task-stats"),
    path("tasks/<int:pk>", views.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<int:pk>/logs", views.TaskLogsView.as_view(), name="task-logs"),
    path("tasks/<int:pk>/events", views.TaskEventsView.as_view(), name="task-events"),
    path("tasks/<int:pk>/metrics", views.TaskMetricsView.as_view(), name="task-metrics"),
    path("tasks/<int:pk>/container-lost", views.ContainerLostView.as_view(), name="task-container-lost"),
    path("tasks/<int:pk>/stop", views.TaskStopView.as_view(), name="task-stop"),
    # queued again with one of explain's suggestions, the waiting task cancelled
    path("tasks/<int:pk>/resubmit", views.TaskResubmitView.as_view(), name="task-resubmit"),
    path("tasks/<int:pk>/cancel", views.TaskStopView.as_view(), name="task-cancel"),
    # the energy and carbon of a tenant's tasks (docs/energy.md#tenants)
    path("usage/energy", energy.TenantEnergyView.as_view(), name="usage-energy"),
    path("task-groups", views.TaskGroupListView.as_view(), name="task-group-list"),
    path("task-groups/<int:pk>", views.TaskGroupDetailView.as_view(), name="task-group-detail"),
    path("task-groups/<int:pk>/stop", views.TaskGroupStopView.as_view(), name="task-group-stop"),
    path("task-groups/<int:pk>/events", views.TaskGroupEventsView.as_view(), name="task-group-events"),
    path("task-groups/<int:pk>/logs", views.TaskGroupLogsView.as_view(), name="task-group-logs"),
]
