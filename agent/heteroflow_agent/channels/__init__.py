"""Command channels: the control plane's intents for this node (slices, images), each
polled and executed by its own threads, apart from the task executor and the beat."""
