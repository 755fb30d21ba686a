"""The slice vendors: how a slice the control plane planned is made on this node's
cards, and unmade.

Each vendor takes a request's action and params (apps.slices.ledger.request_params on
the server: gpu_index, gpu_uuid, profile, memory_mb, compute_percent, device_id,
handles), re-validates it against what the tools say now, runs the tools in sequence
within the request's time budget, and returns an `Outcome` that says exactly what exists
afterwards: on a failure half way, `created` lists what was made so the server can
clean it up. A vendor never raises for a refusal or a tool failure; it reports.
"""
