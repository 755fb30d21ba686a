"""Carbon: which emission factor covers a node, and who sees an absolute carbon figure
(docs/energy.md#carbon). One place for both rules, in Python and, for the statements
that settle a task's carbon or sum a tenant's, as SQL.

The factor: the node's own (`nodes.emission_factor_g_per_kwh`), else its region's
(`emission_factors`, matched on `nodes.region`), else none. Without a factor there is no
absolute figure anywhere: the API says null with the basis `no_factor`, the pages "—".

Who sees a figure (the spec grades carbon by the factor's configuration and the viewer's
role):
- platform operators: every node's and every tenant's carbon, the factor and its source,
  and where none is configured, how to configure one;
- a tenant's admin: the carbon of the tenant's tasks, and of the nodes dedicated to the
  tenant (the nodes a tenant admin manages, as for deletion), with their factor;
- a tenant's members and viewers: the carbon of the tenant's tasks (what they can see
  anyway), not node figures;
- a shared node's carbon is the whole node's, other tenants' work included: operators
  only (a tenant's part of it is its tasks' carbon).

Pure rules over a node row and a principal (duck-typed: `is_operator`, `is_tenant`,
`is_tenant_admin`, `tenant`), so the schema layer holds them, like apps.nodes.gpu_state.
"""

from __future__ import annotations

from dataclasses import dataclass

from apps.nodes.models import EmissionFactor

# What a carbon figure rests on; the API's `carbon.basis`.
FACTOR = "factor"  # a factor covers all of the energy: the figure is given
PARTIAL = "partial"  # some of the energy had no factor: the figure covers the rest (unfactored_kwh says how much)
NO_FACTOR = "no_factor"  # no factor covers the energy: no absolute figure
NO_DATA = "no_data"  # no energy was measured: nothing to convert
NOT_VISIBLE = "not_visible"  # the viewer's role does not see this figure
BASES = (FACTOR, PARTIAL, NO_FACTOR, NO_DATA, NOT_VISIBLE)

NODE, REGION = "node", "region"  # where a factor comes from

# The most a factor may be (g CO2e/kWh); the dirtiest grids are about 1,000 (lignite
# ~1,100): a larger figure is a typo (kg for g), refused.
MAX_FACTOR_G_PER_KWH = 2000.0

CONFIGURE_HINT = (
    "No emission factor covers this node: set its region's with PUT /api/v1/admin/emission-factors/{region} "
    "(or in the admin, Emission factors), or the node's own with PUT /api/v1/admin/nodes/{id}/energy."
)
CONFIGURE_HINT_TASKS = (
    "No emission factor covered the nodes this energy was used on: set their regions' with "
    "PUT /api/v1/admin/emission-factors/{region}, or a node's own with PUT /api/v1/admin/nodes/{id}/energy. "
    "A task's carbon is settled with the factor of its node when it leaves it."
)


def factor_sql(node: str = "n", region_factor: str = "ef") -> str:
    """The factor of the `nodes` row aliased `node`, with `region_factor_join` joined."""
    return f"COALESCE({node}.emission_factor_g_per_kwh, {region_factor}.g_co2e_per_kwh)"


def region_factor_join(node: str = "n", region_factor: str = "ef") -> str:
    return (
        f"LEFT JOIN emission_factors AS {region_factor} "
        f"ON {region_factor}.region = {node}.region AND {node}.region <> ''"
    )


@dataclass(frozen=True)
class Factor:
    g_per_kwh: float
    source: str  # NODE or REGION
    region: str = ""


def factor_for(node) -> Factor | None:
    """The factor covering `node` now (one query when the node has none of its own)."""
    if node.emission_factor_g_per_kwh is not None:
        return Factor(node.emission_factor_g_per_kwh, NODE, node.region)
    if not node.region:
        return None
    value = EmissionFactor.objects.filter(region=node.region).values_list("g_co2e_per_kwh", flat=True).first()
    return None if value is None else Factor(value, REGION, node.region)


def may_see_node_carbon(principal, node) -> bool:
    """Operators: any node. A tenant's admin: the nodes dedicated to the tenant."""
    if principal is None:
        return False
    if principal.is_operator:
        return True
    return bool(principal.is_tenant_admin and node.tenant_id is not None and node.tenant_id == principal.tenant.pk)


def may_see_tenant_carbon(principal, tenant_id) -> bool:
    """Operators: any tenant. A tenant's principals (any role): their own tenant's."""
    if principal is None:
        return False
    if principal.is_operator:
        return True
    return bool(principal.is_tenant and principal.tenant.pk == tenant_id)


def grams(kwh: float | None, factor: Factor | None) -> float | None:
    return None if kwh is None or factor is None else kwh * factor.g_per_kwh


def node_carbon(principal, node, factor: Factor | None, energies_kwh: dict[str, float | None]) -> dict:
    """The `carbon` part of a node's energy: for each named energy (kWh, None: not
    measured) its grams under the node's factor, when the viewer may see it. Every
    figure is null unless the basis is FACTOR."""
    figures = dict.fromkeys((f"{name}_g" for name in energies_kwh), None)
    answer = {"basis": NOT_VISIBLE, "factor_g_per_kwh": None, "factor_source": None, **figures}
    if not may_see_node_carbon(principal, node):
        return answer
    if factor is None:
        answer["basis"] = NO_FACTOR
        if principal.is_operator:
            answer["configure"] = CONFIGURE_HINT
        return answer
    answer |= {"factor_g_per_kwh": factor.g_per_kwh, "factor_source": factor.source}
    if all(kwh is None for kwh in energies_kwh.values()):
        answer["basis"] = NO_DATA
        return answer
    answer["basis"] = FACTOR
    answer |= {f"{name}_g": grams(kwh, factor) for name, kwh in energies_kwh.items()}
    return answer


def settled_carbon(principal, tenant_id, *, energy_wh: float | None, carbon_g: float | None, unfactored_wh: float):
    """The `carbon` part of a tenant's (or a task's) energy: the grams settled with the
    factors of the nodes it ran on, and the energy no factor covered. Null figures unless
    the viewer may see the tenant's carbon and a factor covered some of it."""
    unfactored_kwh = (unfactored_wh or 0.0) / 1000.0
    answer = {"basis": NOT_VISIBLE, "carbon_g": None, "unfactored_kwh": None}
    if not may_see_tenant_carbon(principal, tenant_id):
        return answer
    answer["unfactored_kwh"] = unfactored_kwh if energy_wh is not None else None
    if energy_wh is None:
        answer["basis"] = NO_DATA
    elif carbon_g is None:
        answer["basis"] = NO_FACTOR
        if principal.is_operator:
            answer["configure"] = CONFIGURE_HINT_TASKS
    else:
        answer["basis"] = PARTIAL if unfactored_kwh > 0 else FACTOR
        answer["carbon_g"] = carbon_g
    return answer
