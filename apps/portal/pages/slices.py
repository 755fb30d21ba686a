"""The slices page: the cards carved into slices (a bar of the memory carved, each slice
with its tier and QoS, tenant, task and state) and the caller's slices, paged. Reads
come from apps.slices.selectors, the API's own: operators see every card, a tenant the
cards its slices are on, another tenant's slice there only as carved memory."""

from __future__ import annotations

from django.shortcuts import render

from apps.core.views import visible
from apps.portal.access import portal_page
from apps.portal.pages.common import choice, paginate
from apps.slices.choices import SliceState, Tier
from apps.slices.models import Slice
from apps.slices.selectors import carved_cards, slice_list


@portal_page
def slices(request):
    principal = request.principal
    state = choice(request.GET.get("state", ""), SliceState.values)
    tier = choice(request.GET.get("tier", ""), Tier.values)
    node_id = request.GET.get("node", "")[:128]
    rows = slice_list(visible(Slice, principal), node_id=node_id, state=state, tier=tier)
    return render(
        request,
        "portal/slices.html",
        {
            "cards": carved_cards(principal, node_id=node_id),
            "page": paginate(request, rows, 50),
            "state": state,
            "tier": tier,
            "node_filter": node_id,
            "states": SliceState.choices,
            "tiers": Tier.choices,
        },
    )
