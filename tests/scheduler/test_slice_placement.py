"""The pure core with slicing: a memory-only task on a MIG card takes the smallest
fitting profile (and the ledger holds the profile's memory); a MIG card where no profile
fits is never chosen; slices with no task (releasing, orphaned) still take their room;
the cross-tenant rule holds against every holder of a card. No database."""

from apps.scheduler.core import GpuSnap, PluginSettings, fits, place
from apps.slices.planning import MIG_MODELS
from tests.scheduler.snapshots import SAME_TENANT_ONLY, node, task

H200 = MIG_MODELS["H200 141GB"]


def mig_card(index=0, carved=(0, 0), model=H200, **kw):
    return GpuSnap(
        index, "nvidia", 143771, mig=True, mig_model=model, carved_g=carved[0], carved_memory=carved[1], **kw
    )


def share(id=1, memory=20000, tenant=1, **kw):
    return task(id=id, gpus=0, gpu_memory_mb=memory, tenant=tenant, **kw)


def test_a_share_on_a_mig_card_takes_the_smallest_fitting_profile():
    card = mig_card()
    decisions, failures = place([share(memory=20000)], [node("n", gpus=[card])], PluginSettings(), SAME_TENANT_ONLY)
    assert not failures
    assert decisions[0].memory_mb == 35840  # 1g.35gb: the ledger holds what is carved
    assert (card.carved_g, card.carved_memory) == (1, 2)
    assert card.holders == [(1, 1, 35840)]


def test_no_reserve_on_a_mig_card_the_whole_card_is_a_profile():
    decisions, _ = place([share(memory=144384)], [node("n", gpus=[mig_card()])], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].memory_mb == 144384  # 7g.141gb, though the card reports 143,771 MiB


def test_a_full_mig_card_is_not_chosen_and_the_next_one_is():
    full, free = mig_card(0, carved=(7, 8)), mig_card(1)
    decisions, _ = place([share()], [node("n", gpus=[full, free])], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [1]


def test_a_mig_card_with_memory_left_but_no_profile_left_is_not_chosen():
    # 6 compute slices taken, 2 memory slices left: no 2g, no 3g; only 1g profiles fit
    card = mig_card(carved=(6, 6))
    nodes = [node("n", gpus=[card])]
    assert fits(nodes[0], share(memory=35840), PluginSettings(), SAME_TENANT_ONLY)
    assert not fits(nodes[0], share(memory=40000), PluginSettings(), SAME_TENANT_ONLY)
    _, failures = place([share(memory=40000)], nodes, PluginSettings(), SAME_TENANT_ONLY)
    assert failures[0].code == "InsufficientResources" and failures[0].removed == {"capacity": 1}


def test_later_tasks_of_the_cycle_see_the_profiles_taken():
    card = mig_card()
    queue = [share(id=k, memory=18000) for k in range(1, 10)]
    decisions, failures = place(queue, [node("n", gpus=[card])], PluginSettings(), SAME_TENANT_ONLY)
    assert len(decisions) == 7 and all(d.memory_mb == 18432 for d in decisions)  # 7 × 1g.18gb
    assert [f.task_id for f in failures] == [8, 9]


def test_a_mig_card_whose_model_has_no_table_takes_no_share():
    unknown = mig_card(model=None)
    _, failures = place([share(memory=100)], [node("n", gpus=[unknown])], PluginSettings(), SAME_TENANT_ONLY)
    assert failures[0].removed == {"capacity": 1}


def test_a_slice_with_no_task_takes_its_room_but_serves_no_tenant():
    card = GpuSnap(0, "nvidia", 81920, holders=[(0, None, 60000)])  # releasing, 60 GB
    n = node("n", gpus=[card])
    assert not fits(n, share(memory=20000), PluginSettings(), SAME_TENANT_ONLY)  # 81920 - 8192 - 60000 < 20000
    assert fits(n, share(memory=10000, tenant=7), PluginSettings(), SAME_TENANT_ONLY)  # any tenant: nobody's
    assert not fits(n, task(gpus=1), PluginSettings(), SAME_TENANT_ONLY)  # the card is not free for a whole task


def test_the_sharing_rule_is_asked_about_every_holder_of_a_mig_card():
    grouped = {frozenset({1, 2})}

    def may_share(a, b):
        return a == b or frozenset({a, b}) in grouped

    for holders, tenant, expected in [
        ([(10, 1, 18432)], 1, True),  # same tenant
        ([(10, 2, 18432)], 1, True),  # same group
        ([(10, 3, 18432)], 1, False),  # a third tenant
        ([(10, 2, 18432), (11, 3, 18432)], 1, False),  # one holder outside the group is enough
    ]:
        card = mig_card(carved=(len(holders), len(holders)), holders=list(holders))
        assert fits(node("n", gpus=[card]), share(tenant=tenant), PluginSettings(), may_share) is expected
    # refused for sharing only: the failure says so
    card = mig_card(carved=(1, 1), holders=[(10, 3, 18432)])
    _, failures = place([share(tenant=1)], [node("n", gpus=[card])], PluginSettings(), may_share)
    assert failures[0].code == "NoTenantEligibleGPU" and failures[0].removed == {"tenant_sharing": 1}
