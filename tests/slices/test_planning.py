"""apps.slices.planning, the pure rules: the MIG tables per model (pinned), the model
matching from nvidia-smi's names, the profile choice and fit, tiers and why, compute
shares. No database."""

import pytest

from apps.slices.planning import (
    MIG_MODELS,
    Refusal,
    SlicePlan,
    choose_profile,
    compute_percent,
    is_mig,
    largest_fit_mb,
    mig_model,
    occupancy,
    plan_slice,
    tier_for,
)

# (name, g, memory slices, memory MB) per model, from NVIDIA's MIG user guide
# ("Supported MIG Profiles") and mig-parted's per-device configurations.
TABLES = {
    "A100 40GB": (7, 8, [
        ("1g.5gb", 1, 1, 5120), ("1g.10gb", 1, 2, 10240), ("2g.10gb", 2, 2, 10240),
        ("3g.20gb", 3, 4, 20480), ("4g.20gb", 4, 4, 20480), ("7g.40gb", 7, 8, 40960),
    ]),
    "A100 80GB": (7, 8, [
        ("1g.10gb", 1, 1, 10240), ("1g.20gb", 1, 2, 20480), ("2g.20gb", 2, 2, 20480),
        ("3g.40gb", 3, 4, 40960), ("4g.40gb", 4, 4, 40960), ("7g.80gb", 7, 8, 81920),
    ]),
    "A30 24GB": (4, 4, [("1g.6gb", 1, 1, 6144), ("2g.12gb", 2, 2, 12288), ("4g.24gb", 4, 4, 24576)]),
    "H100 80GB": (7, 8, [
        ("1g.10gb", 1, 1, 10240), ("1g.20gb", 1, 2, 20480), ("2g.20gb", 2, 2, 20480),
        ("3g.40gb", 3, 4, 40960), ("4g.40gb", 4, 4, 40960), ("7g.80gb", 7, 8, 81920),
    ]),
    "H100 NVL 94GB": (7, 8, [
        ("1g.12gb", 1, 1, 12288), ("1g.24gb", 1, 2, 24576), ("2g.24gb", 2, 2, 24576),
        ("3g.47gb", 3, 4, 48128), ("4g.47gb", 4, 4, 48128), ("7g.94gb", 7, 8, 96256),
    ]),
    "H100 96GB": (7, 8, [
        ("1g.12gb", 1, 1, 12288), ("1g.24gb", 1, 2, 24576), ("2g.24gb", 2, 2, 24576),
        ("3g.48gb", 3, 4, 49152), ("4g.48gb", 4, 4, 49152), ("7g.96gb", 7, 8, 98304),
    ]),
    "H200 141GB": (7, 8, [
        ("1g.18gb", 1, 1, 18432), ("1g.35gb", 1, 2, 35840), ("2g.35gb", 2, 2, 35840),
        ("3g.71gb", 3, 4, 72704), ("4g.71gb", 4, 4, 72704), ("7g.141gb", 7, 8, 144384),
    ]),
    "GH200 144GB": (7, 8, [
        ("1g.18gb", 1, 1, 18432), ("1g.36gb", 1, 2, 36864), ("2g.36gb", 2, 2, 36864),
        ("3g.72gb", 3, 4, 73728), ("4g.72gb", 4, 4, 73728), ("7g.144gb", 7, 8, 147456),
    ]),
    "B200 180GB": (7, 8, [
        ("1g.23gb", 1, 1, 23552), ("1g.45gb", 1, 2, 46080), ("2g.45gb", 2, 2, 46080),
        ("3g.90gb", 3, 4, 92160), ("4g.90gb", 4, 4, 92160), ("7g.180gb", 7, 8, 184320),
    ]),
}  # fmt: skip


def test_the_profile_tables_are_pinned_model_by_model():
    assert sorted(MIG_MODELS) == sorted(TABLES)
    for key, (compute, memory, rows) in TABLES.items():
        model = MIG_MODELS[key]
        assert (model.compute_slices, model.memory_slices) == (compute, memory), key
        assert [(p.name, p.g, p.memory_slices, p.memory_mb) for p in model.profiles] == rows, key
        # the whole card is the last profile: every compute and memory slice
        assert (model.profiles[-1].g, model.profiles[-1].memory_slices) == (compute, memory)


@pytest.mark.parametrize(
    ("name", "memory_total_mb", "expected"),
    [
        ("NVIDIA A100-SXM4-40GB", 40960, "A100 40GB"),
        ("NVIDIA A100-PCIE-40GB", None, "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100 80GB"),
        ("NVIDIA A100 80GB PCIe", None, "A100 80GB"),
        ("A100-SXM4-40GB", None, "A100 40GB"),  # older drivers: no "NVIDIA "
        ("NVIDIA A800-SXM4-80GB", 81920, "A100 80GB"),
        ("NVIDIA A30", 24576, "A30 24GB"),
        ("NVIDIA H100 80GB HBM3", 81559, "H100 80GB"),
        ("NVIDIA H100 PCIe", 81559, "H100 80GB"),
        ("NVIDIA H100 NVL", 95830, "H100 NVL 94GB"),
        ("NVIDIA H200", 143771, "H200 141GB"),
        ("NVIDIA H200 NVL", None, "H200 141GB"),
        ("NVIDIA GH200 480GB", 97871, "H100 96GB"),
        ("NVIDIA GH200 144G HBM3e", 146831, "GH200 144GB"),
        ("NVIDIA B200", 183359, "B200 180GB"),
    ],
)
def test_models_are_matched_from_nvidia_smi_names(name, memory_total_mb, expected):
    assert mig_model(name, memory_total_mb).key == expected


@pytest.mark.parametrize(
    ("name", "memory_total_mb"),
    [
        ("NVIDIA GeForce RTX 4090", 24564),  # no MIG
        ("NVIDIA L40S", 46068),
        ("Tesla V100-SXM2-32GB", 32768),
        ("NVIDIA A100", None),  # which one? neither memory nor name says: no guess
        ("", None),
    ],
)
def test_a_card_without_a_table_has_none(name, memory_total_mb):
    assert mig_model(name, memory_total_mb) is None


def test_the_smallest_fitting_profile_is_chosen():
    h200 = MIG_MODELS["H200 141GB"]
    assert choose_profile(h200, 1).name == "1g.18gb"
    assert choose_profile(h200, 18432).name == "1g.18gb"
    assert choose_profile(h200, 18433).name == "1g.35gb"  # 1g before 2g at the same memory
    assert choose_profile(h200, 40_000).name == "3g.71gb"
    assert choose_profile(h200, 80_000).name == "7g.141gb"
    assert choose_profile(h200, 144_385) is None  # more than the card
    a100 = MIG_MODELS["A100 40GB"]
    assert choose_profile(a100, 6000).name == "1g.10gb"


def test_a_profile_fits_only_beside_what_the_live_slices_take():
    h200 = MIG_MODELS["H200 141GB"]
    # six 1g.18gb: 6 of 7 compute, 6 of 8 memory slices
    used = occupancy(h200, [("1g.18gb", 18432)] * 6)
    assert used == (6, 6)
    assert choose_profile(h200, 18432, *used).name == "1g.18gb"
    assert choose_profile(h200, 30_000, *used).name == "1g.35gb"  # 1 compute + 2 memory slices left
    assert choose_profile(h200, 40_000, *used) is None
    assert largest_fit_mb(h200, *used) == 35840
    full = occupancy(h200, [("3g.71gb", 72704), ("4g.71gb", 72704)])
    assert full == (7, 8) and choose_profile(h200, 1, *full) is None and largest_fit_mb(h200, *full) == 0
    assert largest_fit_mb(h200, 0, 0) == 144384
    assert largest_fit_mb(None, 0, 0) == 0  # no table: nothing fits


def test_an_unknown_profile_on_the_card_is_counted_from_its_name_or_takes_the_card():
    h200 = MIG_MODELS["H200 141GB"]
    # an orphan with a +me profile: g from the name, memory slices from its memory
    assert occupancy(h200, [("1g.18gb+me", 18432)]) == (1, 1)
    assert occupancy(h200, [("2g.40gb", 40960)]) == (2, 3)
    assert occupancy(h200, [("", 0)]) == (7, 8)  # says nothing: fail-closed


@pytest.mark.parametrize(
    ("vendor", "capability", "container", "tier", "qos", "why"),
    [
        ("nvidia", {"mig_capable": True, "mps_capable": True}, True, "software", "bronze", "runs in a container"),
        ("nvidia", {"mig_capable": True, "mps_capable": True}, False, "mig", "gold", "MIG mode enabled"),
        ("nvidia", {"mig_capable": False, "mps_capable": True}, False, "mps", "silver", "MPS control daemon alive"),
        ("nvidia", {"mig_capable": False, "mps_capable": False}, False, "software", "bronze", "neither MIG"),
        ("nvidia", None, False, "software", "bronze", "no slicing capabilities"),
        ("nvidia", {"mig_capable": "yes"}, False, "software", "bronze", "neither MIG"),  # only true is true
        ("hygon", {"hami_capable": True}, False, "hami", "silver", "vDCU tool working"),
        ("hygon", {}, False, "software", "bronze", "no working vDCU tool"),
        ("hygon", {"hami_capable": True}, True, "software", "bronze", "runs in a container"),
        ("amd", {"mig_capable": True}, False, "software", "bronze", "amd's cards have no hardware slicing"),
    ],
)
def test_the_tier_is_derived_from_the_card_and_says_why(vendor, capability, container, tier, qos, why):
    choice = tier_for(vendor, capability, is_container=container, index=3)
    assert (choice.tier, choice.qos) == (tier, qos)
    assert why in choice.why
    assert choice.reason == {"tier": tier, "qos": qos, "why": choice.why}
    assert is_mig(vendor, capability, is_container=container) == (tier == "mig")


def test_compute_shares():
    h200, a30 = MIG_MODELS["H200 141GB"], MIG_MODELS["A30 24GB"]
    assert [
        compute_percent("mig", memory_mb=0, memory_total_mb=None, profile=p, model=h200) for p in h200.profiles
    ] == [
        14,
        14,
        29,
        43,
        57,
        100,
    ]
    assert [compute_percent("mig", memory_mb=0, memory_total_mb=None, profile=p, model=a30) for p in a30.profiles] == [
        25,
        50,
        100,
    ]
    assert compute_percent("mps", memory_mb=20480, memory_total_mb=81920) == 25
    assert compute_percent("mps", memory_mb=100, memory_total_mb=81920) == 1  # at least 1
    assert compute_percent("hami", memory_mb=99999, memory_total_mb=81920) == 100
    assert compute_percent("mps", memory_mb=100, memory_total_mb=None) is None
    assert compute_percent("software", memory_mb=20480, memory_total_mb=81920) is None


def card(**kw):
    return {
        "vendor": "nvidia",
        "model_name": "NVIDIA H200",
        "memory_total_mb": 143771,
        "capability": {"mig_capable": True},
        "is_container": False,
        "index": 0,
        "memory_mb": 20000,
    } | kw


def test_a_plan_carries_tier_limits_and_why():
    plan = plan_slice(**card())
    assert isinstance(plan, SlicePlan)
    assert (plan.tier, plan.profile, plan.memory_mb, plan.compute_percent) == ("mig", "1g.35gb", 35840, 14)
    assert plan.reason["qos"] == "gold" and "1g.35gb" in plan.reason["why"]
    mps = plan_slice(**card(capability={"mps_capable": True}))
    assert (mps.tier, mps.profile, mps.memory_mb, mps.compute_percent) == ("mps", "", 20000, 14)
    software = plan_slice(**card(capability={"mig_capable": True}, is_container=True))
    assert (software.tier, software.memory_mb, software.compute_percent) == ("software", 20000, None)


def test_a_plan_is_refused_with_the_reason():
    full = plan_slice(**card(live=[("7g.141gb", 144384)]))
    assert isinstance(full, Refusal) and full.code == "SliceUnplannable"
    assert "no MIG profile of 20000 MB or more left" in full.message and "7/7 compute" in full.message
    too_big = plan_slice(**card(memory_mb=200_000))
    assert "the largest has 144384 MB" in too_big.message
    unknown = plan_slice(**card(model_name="NVIDIA Mystery"))
    assert isinstance(unknown, Refusal) and "no MIG profile table" in unknown.message
