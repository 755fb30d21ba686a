"""Inference engines on this node: which engine and image serves a model (the router),
and what the running engines have loaded (their /v1/models)."""
