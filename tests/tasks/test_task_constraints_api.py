"""A task's hard placement constraints through the API (docs/api.md#tasks): the runtime it
accepts (`runtime`, which may leave out `image` for `process`), node affinity and
anti-affinity. Bad ones are refused naming the field, and nothing is written; a group's
members carry their group's."""

import pytest

from apps.tasks.models import Task, TaskGroup
from tests.headers import bearer

pytestmark = pytest.mark.django_db
JOB = {"name": "probe", "image": "busybox", "command": ["true"], "gpu_required": 0}
GROUP = {"name": "train", "world_size": 2, "gpu_type": "nvidia", "image": "trainer:1"}


def create(api, world, **changes):
    return api.post("/api/v1/tasks", JOB | changes, format="json", **bearer(world.keys["acme-member"]))


def refused(response) -> dict:
    assert response.status_code == 400, response.content
    return response.json()["error"]["fields"]


def test_a_task_with_constraints_keeps_them_as_asked(api, world):
    response = create(
        api,
        world,
        runtime="container",
        affinity={"nodes_with_labels": {"gpu-pool": "a100", "zone/name": "z1"}},
        anti_affinity={"labels": {"maintenance": "soon"}, "same_service": False},
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["runtime"] == "container"
    assert body["affinity"] == {"nodes_with_labels": {"gpu-pool": "a100", "zone/name": "z1"}}
    assert body["anti_affinity"] == {"labels": {"maintenance": "soon"}}  # a false same_service is not stored
    task = Task.objects.get(pk=body["id"])
    assert (task.runtime, task.anti_affinity) == ("container", {"labels": {"maintenance": "soon"}})


def test_the_defaults_keep_todays_behaviour_and_a_task_body_round_trips(api, world):
    body = create(api, world).json()
    assert (body["runtime"], body["affinity"], body["anti_affinity"]) == ("auto", {}, {})
    again = {key: body[key] for key in (*JOB, "runtime", "affinity", "anti_affinity", "labels")}
    assert create(api, world, **again).status_code == 201


def test_a_process_task_may_leave_out_its_image(api, world):
    no_image = {key: value for key, value in JOB.items() if key != "image"}
    response = api.post(
        "/api/v1/tasks", no_image | {"runtime": "process"}, format="json", **bearer(world.keys["acme-member"])
    )
    assert response.status_code == 201, response.content
    assert (response.json()["image"], response.json()["runtime"]) == ("", "process")


@pytest.mark.parametrize(
    "changes,fields",
    [
        ({"image": ""}, {"image": ["This field is required (it may be left out only with runtime process)."]}),
        (
            {"image": "", "runtime": "container"},
            {"image": ["This field is required (it may be left out only with runtime process)."]},
        ),
        (
            {"runtime": "process", "volumes": [{"host": "/data", "container": "/data"}]},
            {
                "volumes": [
                    "The process runtime cannot mount volumes (no container to mount them in); use host paths in "
                    "the command, or runtime container."
                ]
            },
        ),
        ({"runtime": "vm"}, {"runtime": ['"vm" is not a valid choice.']}),
        (
            {"affinity": "gpu-pool=a100"},
            {"affinity": {"non_field_errors": ["Invalid data. Expected a dictionary, but got str."]}},
        ),
        ({"affinity": {"nodes_with_label": {"a": "b"}}}, {"affinity": {"nodes_with_label": ["Unknown field."]}}),
        (
            {"affinity": {"nodes_with_labels": {}}},
            {"affinity": {"nodes_with_labels": ["Name at least one label, or leave this out."]}},
        ),
        (
            {"affinity": {"nodes_with_labels": {"-bad key": "x"}}},
            {"affinity": {"nodes_with_labels": ["'-bad key' is not a node label's name"]}},
        ),
        (
            {"affinity": {"nodes_with_labels": {f"k{n}": "v" for n in range(17)}}},
            {"affinity": {"nodes_with_labels": ["At most 16 labels."]}},
        ),
        (
            {"affinity": {"nodes_with_labels": {"gpu-pool": ["a100"]}}},
            {"affinity": {"nodes_with_labels": {"gpu-pool": ["Not a valid string."]}}},
        ),
        (
            {"anti_affinity": {"same_service": "yes please"}},
            {"anti_affinity": {"same_service": ["Must be a valid boolean."]}},
        ),
        (
            {"anti_affinity": {"same_service": True}},
            {
                "anti_affinity": {
                    "same_service": [
                        "Only an inference service's replicas have a service to keep apart from; use "
                        "anti_affinity.labels to keep this off nodes."
                    ]
                }
            },
        ),
        (
            {
                "affinity": {"nodes_with_labels": {"gpu-pool": "a100", "zone": "z1"}},
                "anti_affinity": {"labels": {"gpu-pool": "a100", "zone": "z2"}},
            },
            {"anti_affinity": {"labels": ["Asked for and avoided at once, so no node could take it: gpu-pool=a100."]}},
        ),
    ],
    ids=[
        "no image",
        "no image for a container",
        "volumes under the process runtime",
        "an unknown runtime",
        "affinity not an object",
        "a misspelt selector",
        "an empty selector",
        "a label key nodes cannot have",
        "too many labels",
        "a label value that is not text",
        "same_service not a boolean",
        "same_service on a task",
        "a label asked for and avoided",
    ],
)
def test_bad_constraints_are_refused_naming_the_field_and_nothing_is_written(api, world, changes, fields):
    assert refused(create(api, world, **changes)) == fields
    assert not Task.objects.exists()


def test_a_groups_members_carry_its_runtime_and_constraints(api, world):
    response = api.post(
        "/api/v1/task-groups",
        GROUP
        | {
            "runtime": "container",
            "affinity": {"nodes_with_labels": {"fabric": "ib"}},
            "anti_affinity": {"labels": {"maintenance": "soon"}},
        },
        format="json",
        **bearer(world.keys["acme-member"]),
    )
    assert response.status_code == 201, response.content
    assert response.json()["affinity"] == {"nodes_with_labels": {"fabric": "ib"}}
    members = Task.objects.filter(group_id=response.json()["id"])
    assert {(t.runtime, str(t.affinity), str(t.anti_affinity)) for t in members} == {
        ("container", str({"nodes_with_labels": {"fabric": "ib"}}), str({"labels": {"maintenance": "soon"}}))
    }


def test_a_group_refuses_same_service_and_a_missing_image_writing_nothing(api, world):
    headers = bearer(world.keys["acme-member"])
    response = api.post(
        "/api/v1/task-groups", GROUP | {"anti_affinity": {"same_service": True}}, format="json", **headers
    )
    assert "same_service" in refused(response)["anti_affinity"]
    no_image = {key: value for key, value in GROUP.items() if key != "image"}
    assert "image" in refused(api.post("/api/v1/task-groups", no_image, format="json", **headers))
    assert (
        api.post("/api/v1/task-groups", no_image | {"runtime": "process"}, format="json", **headers).status_code == 201
    )
    assert TaskGroup.objects.count() == 1 and Task.objects.filter(runtime="process").count() == 2


def test_a_missing_image_is_named_with_the_other_problems(api, world):
    headers = bearer(world.keys["acme-member"])
    fields = refused(api.post("/api/v1/tasks", {"command": ["true"]}, format="json", **headers))
    assert set(fields) == {"name", "image"}
    fields = refused(api.post("/api/v1/tasks", {"runtime": "process", "command": ["true"]}, format="json", **headers))
    assert set(fields) == {"name"}
    assert not Task.objects.exists()
