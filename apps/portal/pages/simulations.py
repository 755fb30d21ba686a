"""Replays under other policies, for operators (docs/simulate.md#from-the-api-hf-and-the-portal):
a form that queues one on this cluster's history or a generated trace, with one or two
layouts; the latest runs; a run's progress, figures and charts. The same write module as
POST /api/v1/admin/simulations."""

from __future__ import annotations

import base64

from django.contrib import messages
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from apps.portal.access import operators_only, portal_page
from apps.scheduler import simulate, simulations
from apps.scheduler.models import Simulation

LAYOUTS = ("this cluster", "binpack", "spread")


def request_from_form(post) -> dict:
    """The form as the API's request: the work (history window or generated trace) and
    one policy per layout chosen (this cluster's own for "this cluster")."""
    if post.get("work") == "generate":
        work = {"generate": {"jobs": int(post.get("jobs") or 0), "days": float(post.get("days") or 2), "seed": 1}}
    else:
        work = {"from_history_days": float(post.get("history_days") or 7)}
    policies = []
    for field in ("policy", "compare"):
        layout = post.get(field, "")
        if layout in ("binpack", "spread"):
            policies.append({"name": layout, "layout": layout})
    return {"work": work, "fleet": None, "policies": policies}


@portal_page
@operators_only
def simulation_list(request):
    if request.method == "POST":
        try:
            body = request_from_form(request.POST)
            jobs = body["work"].get("generate", {}).get("jobs")
            if jobs is not None and not 1 <= jobs <= 200_000:
                raise simulate.SimulationInputError("A generated trace has 1 to 200,000 jobs.")
            simulation = simulations.request_simulation(request.user, body)
        except ValueError as exc:  # a bad number, SimulationInputError, TraceError
            messages.error(request, f"Not queued: {exc}")
        else:
            messages.success(request, f"Simulation {simulation.pk} queued.")
            return redirect("portal:simulation", simulation.pk)
    return render(
        request,
        "portal/simulations.html",
        {"runs": Simulation.objects.select_related("created_by")[:50], "layouts": LAYOUTS, "form": request.POST},
    )


@portal_page
@operators_only
def simulation_detail(request, pk):
    simulation = get_object_or_404(Simulation, pk=pk)
    runs = (simulation.report or {}).get("runs", [])
    return render(
        request,
        "portal/simulation_detail.html",
        {
            "simulation": simulation,
            "percent": round(100 * simulation.progress),
            "runs": runs,
            "charts": sorted(simulation.charts),
            "live": simulation.state in (Simulation.State.QUEUED, Simulation.State.RUNNING),
        },
    )


@portal_page
@operators_only
def simulation_chart(request, pk, name):
    png = get_object_or_404(Simulation, pk=pk).charts.get(name)
    if png is None:
        raise Http404(f"No chart {name!r}.")
    return HttpResponse(base64.b64decode(png), content_type="image/png")
