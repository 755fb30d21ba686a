from django.urls import path

from apps.scheduler.api import predictions, queues, simulations, views

urlpatterns = [
    path("scheduler/plugins", views.PluginListView.as_view(), name="scheduler-plugins"),
    path("plugins/<str:name>", views.PluginView.as_view(), name="scheduler-plugin"),
    path("scheduler/dry-run", views.DryRunView.as_view(), name="scheduler-dry-run"),
    path("scheduler/dry-run/group", views.GroupDryRunView.as_view(), name="scheduler-group-dry-run"),
    # beside the task-group API (apps/tasks/api), the scheduler's account of one group
    path("task-groups/<int:pk>/explain", views.GroupExplainView.as_view(), name="task-group-explain"),
    # beside the task API: why one task waits, with the cards' memory numbers
    path("tasks/<int:pk>/explain", views.TaskExplainView.as_view(), name="task-explain"),
    # queues (docs/queues.md): operators set each tenant's, its people see theirs
    path("admin/queues", queues.AdminQueueListView.as_view(), name="admin-queues"),
    path("admin/queues/<slug:slug>", queues.AdminQueueView.as_view(), name="admin-queue"),
    path("queue", queues.QueueView.as_view(), name="queue"),
    # how accurate the start-time estimates were (docs/predictions.md#accuracy)
    path("admin/predictions/accuracy", predictions.PredictionAccuracyView.as_view(), name="prediction-accuracy"),
    # replays under other policies (docs/simulate.md#from-the-api-hf-and-the-portal)
    path("admin/simulations", simulations.SimulationListView.as_view(), name="simulations"),
    path("admin/simulations/<int:pk>", simulations.SimulationView.as_view(), name="simulation"),
    path(
        "admin/simulations/<int:pk>/charts/<slug:name>.png",
        simulations.SimulationChartView.as_view(),
        name="simulation-chart",
    ),
]
