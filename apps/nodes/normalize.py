"""Server-side corrections of facts agents are known to get wrong."""

# Biren's tool reports a generic name; the memory size tells the models apart.
BIREN_MODEL_BY_MEMORY_MB = {32512: "BR106M", 65536: "BR100"}


def gpu_model(vendor: str, model: str, memory_total_mb: int | None) -> str:
    if vendor == "biren" and memory_total_mb in BIREN_MODEL_BY_MEMORY_MB:
        return BIREN_MODEL_BY_MEMORY_MB[memory_total_mb]
    return model or ""
