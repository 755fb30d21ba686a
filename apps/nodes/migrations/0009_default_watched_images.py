"""The default watched images (docs/images.md): per GPU vendor its inference engines'
images and its base and training images, and one base image for every vendor. Bare
repositories, so that a check lists every local tag (which versions a node has); each
is marked "default" in its note. Operators edit the list (the admin, or
/api/v1/watched-images); unapplying removes only the defaults still as seeded."""

from django.db import migrations

DEFAULT = "default (nodes/0009)"

# (vendor, reference, kind, what it is); vendor "": every vendor
DEFAULTS = [
    ("", "ubuntu:22.04", "base", "the common base image"),
    ("nvidia", "vllm/vllm-openai", "engine", "vLLM, OpenAI-compatible server (CUDA)"),
    ("nvidia", "lmsysorg/sglang", "engine", "SGLang server (CUDA)"),
    ("nvidia", "nvidia/cuda", "base", "CUDA base images"),
    ("nvidia", "pytorch/pytorch", "training", "PyTorch with CUDA"),
    ("nvidia", "nvcr.io/nvidia/pytorch", "training", "NGC PyTorch"),
    ("amd", "rocm/vllm", "engine", "vLLM for ROCm"),
    ("amd", "rocm/dev-ubuntu-22.04", "base", "ROCm base image"),
    ("amd", "rocm/pytorch", "training", "PyTorch for ROCm"),
    ("ascend", "swr.cn-south-1.myhuaweicloud.com/ascendhub/mindie", "engine", "MindIE inference (Ascend hub)"),
    ("ascend", "quay.io/ascend/vllm-ascend", "engine", "vLLM Ascend"),
    ("ascend", "ascendai/cann", "base", "CANN base image"),
    ("ascend", "ascendai/pytorch", "training", "PyTorch with torch_npu"),
    ("hygon", "image.sourcefind.cn:5000/dcu/admin/base/vllm", "engine", "vLLM for Hygon DCU (SourceFind)"),
    ("hygon", "image.sourcefind.cn:5000/dcu/admin/base/pytorch", "training", "PyTorch for Hygon DCU (SourceFind)"),
]


def seed(apps, schema_editor):
    WatchedImage = apps.get_model("nodes", "WatchedImage")
    for vendor, reference, kind, what in DEFAULTS:
        WatchedImage.objects.get_or_create(
            vendor=vendor, reference=reference, defaults={"kind": kind, "note": f"{DEFAULT}: {what}"}
        )


def unseed(apps, schema_editor):
    WatchedImage = apps.get_model("nodes", "WatchedImage")
    for vendor, reference, _, _ in DEFAULTS:
        WatchedImage.objects.filter(vendor=vendor, reference=reference, note__startswith=DEFAULT).delete()


class Migration(migrations.Migration):
    dependencies = [("nodes", "0008_image_channel")]

    operations = [migrations.RunPython(seed, unseed)]
