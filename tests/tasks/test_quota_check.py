"""The quota is checked in one function (apps.tasks.services.quota_refusal) by every way
into the counted set: a create (create_tasks, and so a group and an array) and a replica
slot back to the queue (requeue_replicas)."""

import ast

from apps.tasks.services import Asked, asked
from tests.spelling import name_of, sources, spelled, tree

CHECKERS = {
    ("apps/tasks/services.py", "quota_refusal"),
    # not a check before a write: the alert recovers once a one-GPU task would fit again
    ("apps/alerts/failures.py", "recover_quota_alerts"),
}


def test_gpu_memory_is_asked_per_gpu_as_the_counter_counts_it():
    assert asked([(2, 1000), (0, 500), (1, None)]) == Asked(tasks=3, gpus=3, gpu_memory_mb=2500)
    assert asked([]) == Asked(0, 0, 0)


def functions_calling(name: str) -> set[tuple[str, str]]:
    found = set()
    for path in sources():
        for function in ast.walk(tree(path)):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] == name
                for node in ast.walk(function)
            ):
                found.add((name_of(path), function.name))
    return found


def test_one_function_checks_the_quota():
    assert functions_calling("quota_problems") == CHECKERS
    assert {
        ("apps/tasks/services.py", "create_tasks"),
        ("apps/tasks/services.py", "requeue_replicas"),
    } <= functions_calling("quota_refusal")
    refusals = spelled(r"^Quota of tenant", home=set())
    assert len(refusals) == 1 and refusals[0].startswith("apps/tasks/services.py:"), refusals
