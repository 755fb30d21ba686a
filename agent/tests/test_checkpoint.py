"""Checkpoint resume: only complete checkpoints count, the newest wins, symlinks are not
followed, an explicit resume point is used as given."""

import os
import time

import pytest

from heteroflow_agent.checkpoint import complete_checkpoints, resume_point
from heteroflow_agent.runtime import Volume


def touch(path, text="", age=0.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


@pytest.fixture
def ckpt(tmp_path):
    return tmp_path / "ckpt"


def test_each_frameworks_evidence_of_completion(ckpt):
    touch(ckpt / "megatron" / "latest_checkpointed_iteration.txt", "2000")
    (ckpt / "megatron" / "iter_0002000").mkdir()
    (ckpt / "megatron" / "iter_0003000").mkdir()  # newer but not recorded: incomplete
    touch(ckpt / "ds" / "latest", "global_step500")
    touch(ckpt / "ds" / "global_step500" / "mp_rank_00_model_states.pt")
    touch(ckpt / "ds-empty" / "latest", "global_step9")
    (ckpt / "ds-empty" / "global_step9").mkdir()  # no shard: incomplete
    touch(ckpt / "tf" / "checkpoint", 'model_checkpoint_path: "ckpt-7"\nall_model_checkpoint_paths: "ckpt-7"')
    touch(ckpt / "tf" / "ckpt-7.index")
    touch(ckpt / "dcp" / "step-100" / ".metadata")
    touch(ckpt / "marked" / "epoch-3" / ".heteroflow_complete")
    (ckpt / "half-written" / "epoch-4").mkdir(parents=True)
    found = {(os.path.relpath(f.host_path, ckpt), f.framework) for f in complete_checkpoints(ckpt)}
    assert found == {
        ("megatron/iter_0002000", "megatron"),
        ("ds/global_step500", "deepspeed"),
        ("tf/ckpt-7", "tensorflow"),
        ("dcp/step-100", "dcp"),
        ("marked/epoch-3", "marker"),
    }


def test_the_newest_complete_one_is_injected_as_a_container_path(tmp_path):
    host = tmp_path / "data" / "run1"
    touch(host / "ckpt" / "epoch-1" / ".heteroflow_complete", age=600)
    touch(host / "ckpt" / "epoch-2" / ".heteroflow_complete", age=60)
    (host / "ckpt" / "epoch-3").mkdir()  # being written
    task = {"kind": "training", "checkpoint_path": "/workspace/ckpt"}
    resume, decision = resume_point(task, [Volume(str(host), "/workspace")])
    assert resume == "/workspace/ckpt/epoch-2" and "marker" in decision


def test_symlinks_are_not_followed(tmp_path):
    outside = tmp_path / "outside" / "epoch-9"
    touch(outside / ".heteroflow_complete")
    root = tmp_path / "data"
    root.mkdir()
    (root / "epoch-9").symlink_to(outside)
    assert complete_checkpoints(root) == []


@pytest.mark.parametrize(
    "task,expected,said",
    [
        ({"kind": "job", "checkpoint_path": "/ckpt"}, None, ""),
        ({"kind": "training", "checkpoint_path": ""}, None, ""),
        (
            {"kind": "training", "checkpoint_path": "/ckpt", "resume_from_checkpoint": "/ckpt/step-5"},
            "/ckpt/step-5",
            "not probed",
        ),
        ({"kind": "training", "checkpoint_path": "/elsewhere"}, None, "not on a volume"),
        ({"kind": "training", "checkpoint_path": "/ckpt"}, None, "no complete checkpoint"),
    ],
)
def test_what_is_decided_without_a_checkpoint_to_resume(tmp_path, task, expected, said):
    (tmp_path / "empty").mkdir()
    resume, decision = resume_point(task, [Volume(str(tmp_path / "empty"), "/ckpt")])
    assert resume == expected and said in decision
