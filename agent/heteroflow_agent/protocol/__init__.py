"""The agent's side of the contract with the control plane: the JSON Schemas of the
heartbeat and the image channel (read by the server's tests and routes from this folder)
and the task-status vocabulary (task_status). The bottom layer of the agent: it imports
nothing of it."""
