"""The inference engines' names, as the router, the launch table and the heartbeat spell
them. The bottom of engines/: the launch table and the router both read them, and the
router reads the launch table, so the imports point one way (names ← launch ← router)."""

AUTO = "auto"
VLLM, SGLANG, MINDIE, LLAMACPP = "vllm", "sglang", "mindie", "llama.cpp"
ROUTED_ENGINES = (VLLM, SGLANG, MINDIE, LLAMACPP)
ANY_VENDOR = "*"  # llama.cpp's image runs everywhere (its tags pick CUDA, ROCm or CPU)
