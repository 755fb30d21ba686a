"""Which idle inference replicas a training task may borrow, and where (the pure core,
apps.scheduler.core.lending): no database, the services as data."""

from apps.scheduler.core import (
    GpuSnap,
    GroupReq,
    LendingService,
    NodeSnap,
    PluginSettings,
    TaskReq,
    lendable_counts,
    plan_group_loan,
    plan_loan,
)

SETTINGS = PluginSettings()
ACME, BETA, PARTNER = 1, 2, 3


def may_share(a, b):
    return a == b or {a, b} == {ACME, PARTNER}


def node(node_id, holders):
    """A node whose card i is held whole by holders[i] ((task id, tenant) or None: free)."""
    gpus = [
        GpuSnap(index=i, vendor="nvidia", memory_total_mb=81920, holders=[(h[0], h[1], None)] if h else [])
        for i, h in enumerate(holders)
    ]
    return NodeSnap(id=node_id, status="online", executable=True, gpus=gpus)


def chat(pk=10, tenant=ACME, *, replicas=2, min_replicas=1, need=0, slots=(), **fields):
    return LendingService(
        id=pk,
        tenant_id=tenant,
        lendable=fields.pop("lendable", True),
        state=fields.pop("state", "running"),
        replicas=replicas,
        min_replicas=min_replicas,
        need=need,
        settled=fields.pop("settled", True),
        slots=tuple(slots),
        **fields,
    )


def train(gpus=1, tenant=ACME, kind="training"):
    return TaskReq(id=99, tenant_id=tenant, gpu_required=gpus, gpu_type="nvidia", kind=kind)


def test_lendable_counts_follow_the_minimum_the_reading_and_the_cap():
    assert lendable_counts(chat(replicas=4, min_replicas=1, need=2), cap=8) == (1, 2)
    assert lendable_counts(chat(replicas=4, min_replicas=3, need=0), cap=8) == (1, 4)  # 4: put to sleep
    assert lendable_counts(chat(replicas=4, min_replicas=1, need=0), cap=2) == (1, 2)  # sleeping needs all 4
    assert lendable_counts(chat(replicas=2, min_replicas=2, need=0), cap=2) == (2,)
    assert lendable_counts(chat(replicas=2, need=2), cap=8) == ()  # busy
    assert lendable_counts(chat(need=None), cap=8) == ()  # no reading: not known idle
    assert lendable_counts(chat(lendable=False), cap=8) == ()
    assert lendable_counts(chat(state="waking"), cap=8) == ()
    assert lendable_counts(chat(settled=False), cap=8) == ()
    assert lendable_counts(chat(on_loan=True), cap=8) == ()
    assert lendable_counts(chat(), cap=0) == ()


def test_the_highest_rank_is_lent_first_and_only_as_much_as_needed():
    # ranks 2, 1 on n1 (lending order: highest first), rank 0 on n2
    service = chat(replicas=3, need=0, slots=[(12, "n1"), (11, "n1"), (10, "n2")])
    nodes = [node("n1", [(12, ACME), (11, ACME)]), node("n2", [(10, ACME), None])]
    plan = plan_loan(train(gpus=2), nodes, [service], SETTINGS, may_share, cap=8)
    assert (plan.node_id, plan.lent, plan.replicas, plan.sleeps) == ("n1", {10: 2}, [11, 12], frozenset())
    assert plan.counts == {10: 3}
    assert plan.as_reason({10: "chat"})["services"] == [
        {"service_id": 10, "name": "chat", "replicas": 2, "sleeps": False}
    ]


def test_freeing_a_low_rank_lends_every_rank_above_it_and_a_whole_service_sleeps():
    # min 2 of 2: only sleeping lends; rank 0 is on n1 beside a free card
    service = chat(replicas=2, min_replicas=2, need=0, slots=[(11, "n2"), (10, "n1")])
    nodes = [node("n1", [(10, ACME), None]), node("n2", [(11, ACME), (50, BETA)])]
    plan = plan_loan(train(gpus=2), nodes, [service], SETTINGS, may_share, cap=8)
    assert (plan.node_id, plan.lent, plan.sleeps, plan.replicas) == ("n1", {10: 2}, frozenset({10}), [10, 11])


def test_the_fewest_replicas_win_across_nodes_then_the_node_id():
    a = chat(pk=10, replicas=3, need=0, slots=[(12, "n2"), (11, "n2"), (10, "n1")])
    nodes = [node("n1", [(10, ACME), None]), node("n2", [(12, ACME), (11, ACME)])]
    plan = plan_loan(train(gpus=2), nodes, [a], SETTINGS, may_share, cap=8)
    assert plan.node_id == "n2" and plan.lent == {10: 2}  # n1 would need all 3 (rank 0 is last)


def test_nothing_is_planned_when_lending_every_candidate_is_not_enough():
    service = chat(replicas=2, need=0, slots=[(11, "n1"), (10, "n1")])
    nodes = [node("n1", [(11, ACME), (10, ACME), (50, BETA)])]
    assert plan_loan(train(gpus=3), nodes, [service], SETTINGS, may_share, cap=8) is None
    # the cap: one replica may be lent, two are needed
    assert plan_loan(train(gpus=2), nodes, [service], SETTINGS, may_share, cap=1) is None


def test_another_tenants_replicas_are_never_lent_a_groups_members_are():
    beta = chat(pk=20, tenant=BETA, need=0, slots=[(21, "n1"), (20, "n1")])
    partner = chat(pk=30, tenant=PARTNER, need=0, slots=[(31, "n1"), (30, "n1")])
    n1 = node("n1", [(21, BETA), (20, BETA)])
    assert plan_loan(train(), [n1], [beta], SETTINGS, may_share, cap=8) is None
    n1 = node("n1", [(31, PARTNER), (30, PARTNER)])
    assert plan_loan(train(), [n1], [partner], SETTINGS, may_share, cap=8).lent == {30: 1}

    def refuses(a, b):  # the rule's query failed: nobody shares (fail-closed)
        return a == b

    assert plan_loan(train(), [n1], [partner], SETTINGS, refuses, cap=8) is None


def test_only_whole_card_training_borrows_and_a_taken_service_lends_once_a_cycle():
    service = chat(need=0, slots=[(11, "n1"), (10, "n1")])
    n1 = node("n1", [(11, ACME), (10, ACME)])
    assert plan_loan(train(kind="job"), [n1], [service], SETTINGS, may_share, cap=8) is None
    share = TaskReq(id=98, tenant_id=ACME, gpu_required=0, gpu_memory_mb=1024, kind="training")
    assert plan_loan(share, [n1], [service], SETTINGS, may_share, cap=8) is None
    assert plan_loan(train(), [n1], [service], SETTINGS, may_share, cap=8, taken={10}) is None


def test_a_node_removed_for_what_lending_does_not_change_is_not_planned():
    service = chat(need=0, slots=[(11, "n1"), (10, "n1")])
    n1 = node("n1", [(11, ACME), (10, ACME)])
    n1.executable = False
    assert plan_loan(train(), [n1], [service], SETTINGS, may_share, cap=8) is None


def gang(workers=2, gpus=1, tenant=ACME, kind="training"):
    return GroupReq(
        id=70,
        tenant_id=tenant,
        members=tuple(range(700, 700 + workers)),
        gpus_per_worker=gpus,
        gpu_type="nvidia",
        kind=kind,
    )


def test_a_task_group_borrows_the_fewest_replicas_its_workers_need_across_nodes():
    service = chat(replicas=3, need=0, slots=[(12, "n1"), (11, "n2"), (10, "n2")])
    n1 = node("n1", [(12, ACME), None])
    n2 = node("n2", [(11, ACME), (10, ACME)])
    plan = plan_group_loan(gang(workers=3), [n1, n2], [service], SETTINGS, may_share, cap=8)
    assert (plan.group_id, plan.task_id, plan.lent, plan.replicas) == (70, 700, {10: 2}, [11, 12])
    assert plan.nodes == ["n1", "n2"] and plan.node_id in plan.nodes
    assert plan.as_reason({10: "chat"})["nodes"] == ["n1", "n2"]
    # the snapshot is left as it was: the planning placed its workers on copies
    assert [gpu.holders for gpu in n1.gpus] == [[(12, ACME, None)], []]


def test_a_task_group_borrows_nothing_it_cannot_use_whole():
    service = chat(replicas=2, need=0, slots=[(11, "n1"), (10, "n1")])
    n1 = node("n1", [(11, ACME), (10, ACME)])
    assert plan_group_loan(gang(workers=3), [n1], [service], SETTINGS, may_share, cap=8) is None
    assert plan_group_loan(gang(kind="inference"), [n1], [service], SETTINGS, may_share, cap=8) is None
    assert plan_group_loan(gang(tenant=BETA), [n1], [service], SETTINGS, may_share, cap=8) is None
