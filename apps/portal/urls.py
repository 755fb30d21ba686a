from django.urls import path

from apps.portal import login, views
from apps.portal.pages import (
    account,
    alerts,
    energy,
    gateway,
    gpu_health,
    inference,
    models,
    nodes,
    predictions,
    queues,
    server,
    simulations,
    tasks,
    terminal,
    training,
)
from apps.portal.pages import slices as slice_pages

app_name = "portal"
urlpatterns = [
    path("", views.home, name="home"),
    path("login/", login.LoginView.as_view(), name="login"),
    path("logout/", login.logout_view, name="logout"),
    path("tenant/", views.switch_tenant, name="switch-tenant"),
    path("server/hosts/", server.server_hosts, name="server-hosts"),
    # nodes
    path("nodes/", nodes.node_list, name="nodes"),
    path("node-cards/", nodes.node_cards, name="node-cards"),  # the nodes page's refresh (JSON)
    path("nodes/monitor/", nodes.node_monitor, name="node-monitor"),
    # card health (before nodes/<id>/: "gpu-health" is not a node)
    path("nodes/gpu-health/", gpu_health.gpu_health, name="gpu-health"),
    path("nodes/<str:node_id>/gpus/<int:index>/cordon/", gpu_health.gpu_cordon, name="gpu-cordon"),
    path("nodes/<str:node_id>/gpus/<int:index>/uncordon/", gpu_health.gpu_uncordon, name="gpu-uncordon"),
    path("nodes/<str:node_id>/", nodes.node_detail, name="node"),
    path("nodes/<str:node_id>/location/", nodes.node_location, name="node-location"),
    path("nodes/<str:node_id>/tenant/", nodes.node_tenant, name="node-tenant"),
    path("nodes/<str:node_id>/delete/", nodes.node_delete, name="node-delete"),
    path("environment/", nodes.environment, name="environment"),
    # slices (cards carved for memory-only tasks)
    path("slices/", slice_pages.slices, name="slices"),
    # tasks
    path("tasks/", tasks.task_list, name="tasks"),
    path("tasks/new/", tasks.task_new, name="task-new"),
    path("tasks/<int:pk>/", tasks.task_detail, name="task"),
    path("tasks/<int:pk>/stop/", tasks.task_stop, name="task-stop"),
    path("tasks/<int:pk>/resubmit/", tasks.task_resubmit, name="task-resubmit"),
    path("tasks/<int:pk>/terminal/", terminal.terminal, name="terminal"),
    path("tasks/<int:pk>/terminal/ticket/", terminal.terminal_ticket, name="terminal-ticket"),
    path("tasks/<int:pk>/open/", terminal.task_open, name="task-open"),
    # training (task groups)
    path("training/", training.training_list, name="training"),
    path("training/new/", training.training_new, name="training-new"),
    path("training/<int:pk>/", training.training_detail, name="training-group"),
    path("training/<int:pk>/stop/", training.training_stop, name="training-stop"),
    # models (the inference registry)
    path("models/", models.model_list, name="models"),
    path("models/new/", models.model_new, name="model-new"),
    path("models/<int:pk>/", models.model_detail, name="model"),
    path("models/<int:pk>/edit/", models.model_edit, name="model-edit"),
    path("models/<int:pk>/delete/", models.model_delete, name="model-delete"),
    # inference services
    path("inference/", inference.service_list, name="inference"),
    path("inference/new/", inference.service_new, name="inference-new"),
    path("inference/<int:pk>/", inference.service_detail, name="inference-service"),
    path("inference/<int:pk>/scale/", inference.service_scale, name="inference-scale"),
    path("inference/<int:pk>/stop/", inference.service_stop, name="inference-stop"),
    path("inference/<int:pk>/wake/", inference.service_wake, name="inference-wake"),
    # endpoint keys (the gateway)
    path("endpoint-keys/", gateway.endpoint_keys, name="endpoint-keys"),
    path("endpoint-keys/<int:pk>/rotate/", gateway.endpoint_key_rotate, name="endpoint-key-rotate"),
    path("endpoint-keys/<int:pk>/revoke/", gateway.endpoint_key_revoke, name="endpoint-key-revoke"),
    path("gateway-usage/", gateway.usage, name="gateway-usage"),
    path("energy/", energy.energy, name="energy"),
    path("queues/", queues.queues, name="queues"),
    path("queues/estimates/", predictions.prediction_accuracy, name="prediction-accuracy"),
    path("queues/simulations/", simulations.simulation_list, name="simulations"),
    path("queues/simulations/<int:pk>/", simulations.simulation_detail, name="simulation"),
    path("queues/simulations/<int:pk>/<slug:name>.png", simulations.simulation_chart, name="simulation-chart"),
    # alerts
    path("alerts/", alerts.alert_list, name="alerts"),
    path("alerts/<int:pk>/", alerts.alert_detail, name="alert"),
    path("alerts/<int:pk>/acknowledge/", alerts.alert_acknowledge, name="alert-acknowledge"),
    path("alerts/<int:pk>/resolve/", alerts.alert_resolve, name="alert-resolve"),
    # account
    path("keys/", account.keys, name="keys"),
    path("keys/<int:pk>/revoke/", account.key_revoke, name="key-revoke"),
    path("members/", account.members, name="members"),
    path("members/<int:pk>/", account.member_change, name="member"),
]
