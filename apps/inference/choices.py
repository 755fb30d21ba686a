"""The registry's vocabularies: where a model's weights come from, the formats they come
in, and the engines that serve them. The engine names are the agent's: the heartbeat's
`inference_engines` (agent/heteroflow_agent/inventory.py) and its engine router's
(engines/router.py, `llama.cpp` with its dot); tests/inference pins that every engine the
agent can report is known here."""

from django.db import models


class SourceKind(models.TextChoices):
    PATH = "path", "a path on the nodes' model cache"
    IMAGE = "image", "a registry image that contains the weights"
    HUB = "hub", "a hub id (for clusters that can reach one)"


class ModelFormat(models.TextChoices):
    SAFETENSORS = "safetensors"
    GGUF = "gguf"
    ONNX = "onnx"
    PYTORCH = "pytorch", "PyTorch (.bin / .pt)"
    OM = "om", "Ascend offline model (MindIE)"
    CAMBRICON = "cambricon", "Cambricon MagicMind"
    TENSORRT = "tensorrt", "TensorRT engine"


class Engine(models.TextChoices):
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
    MINDIE = "mindie", "MindIE (Ascend)"
    LLAMACPP = "llama.cpp"
    TGI = "tgi", "Text Generation Inference"
    LMDEPLOY = "lmdeploy", "LMDeploy"
    OLLAMA = "ollama", "Ollama"
    TRITON = "triton", "Triton Inference Server"


class ServiceStatus(models.TextChoices):
    """A service's state, as the pure state machine (apps.inference.sleep.ServiceState)
    names them; tests/inference pins the two in step."""

    STARTING = "starting"
    RUNNING = "running"
    SLEEPING = "sleeping"
    WAKING = "waking"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
