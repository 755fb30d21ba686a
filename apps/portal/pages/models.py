"""The models pages: the tenant's model registry, where each model is cached, the
register form, a model's detail and its deletion. The form is decoded into the API's
shape and validated by the API's own ModelCreateSerializer, then registered through
apps.inference.services like POST /api/v1/models: the same rules and the same words."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from apps.core.errors import Conflict
from apps.core.views import get_visible_or_404, visible
from apps.inference import model_deletion, selectors, services
from apps.inference.api.serializers import ModelCreateSerializer, ModelUpdateSerializer
from apps.inference.choices import Engine, ModelFormat, SourceKind
from apps.inference.models import Model
from apps.portal.access import portal_page
from apps.portal.pages.common import choice, paginate, through_api, through_api_for_a_tenant
from apps.portal.pages.tasks import lines
from apps.tenants import policy
from apps.tenants.models import Tenant


def form_to_request(post, principal) -> dict:
    """The form's fields as the JSON body POST /api/v1/models takes; optional fields left
    empty are omitted, so the API's defaults apply."""
    data = {
        "name": post.get("name", "").strip(),
        "source_kind": post.get("source_kind", ""),
        "source": post.get("source", "").strip(),
        "format": post.get("format", ""),
        "engines": post.getlist("engines"),
        "nodes": lines(post.get("nodes", "").replace(",", "\n")),
    }
    size = post.get("size_bytes", "").strip()
    if size:
        data["size_bytes"] = size
    if principal.is_operator and post.get("tenant"):
        data["tenant"] = post["tenant"]
    return data


@portal_page
def model_list(request):
    principal = request.principal
    format = choice(request.GET.get("format", ""), ModelFormat.values)
    engine = choice(request.GET.get("engine", ""), Engine.values)
    page = paginate(request, selectors.model_list(visible(Model, principal), format=format, engine=engine), 50)
    cached = selectors.cached_on(page)
    for model in page:
        model.cached = cached[model.pk]
    return render(
        request,
        "portal/models.html",
        {
            "page": page,
            "format": format,
            "engine": engine,
            "formats": ModelFormat.choices,
            "engines": Engine.choices,
            "may_create": policy.may_manage_models(principal, principal.tenant),
        },
    )


@portal_page
def model_new(request):
    principal = request.principal
    policy.check_may_manage_models(principal, principal.tenant)
    errors: dict[str, list[str]] = {}
    if request.method == "POST":
        model, errors = through_api_for_a_tenant(
            ModelCreateSerializer,
            form_to_request(request.POST, principal),
            lambda data: services.register_model(principal, data),
        )
        if not errors:
            messages.success(request, f"Model '{model.name}' registered.")
            return redirect("portal:model", model.pk)
    return render(
        request,
        "portal/model_new.html",
        {
            "form": request.POST if request.method == "POST" else {},
            "chosen_engines": request.POST.getlist("engines") if request.method == "POST" else [],
            "errors": errors,
            "kinds": SourceKind.choices,
            "formats": ModelFormat.choices,
            "engines": Engine.choices,
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
        },
        status=400 if errors else 200,
    )


@portal_page
def model_detail(request, pk):
    principal = request.principal
    model = get_visible_or_404(Model.objects.select_related("tenant").prefetch_related("nodes"), principal, pk=pk)
    return render(
        request,
        "portal/model_detail.html",
        {
            "model": model,
            "nodes": sorted(node.pk for node in model.nodes.all()),
            "cached": selectors.cached_on([model])[model.pk],
            "services": model.services.select_related("group").order_by("group__name", "group_id"),
            "may_change": policy.may_manage_models(principal, model.tenant),
            "engines": Engine.choices,
        },
    )


@require_POST
@portal_page
def model_edit(request, pk):
    """The detail page's change form: the body of PATCH /api/v1/models/{id} with all three
    fields (an empty size: not known; no engine ticked: the router chooses; no node: not
    pinned), validated by the API's ModelUpdateSerializer."""
    principal = request.principal
    model = get_visible_or_404(Model.objects.select_related("tenant"), principal, pk=pk)
    policy.check_may_manage_models(principal, model.tenant)
    size = request.POST.get("size_bytes", "").strip()
    data = {
        "size_bytes": size or None,
        "engines": request.POST.getlist("engines"),
        "nodes": lines(request.POST.get("nodes", "").replace(",", "\n")),
    }
    _, errors = through_api(ModelUpdateSerializer, data, lambda valid: services.update_model(principal, model, valid))
    for field, problems in errors.items():
        messages.error(request, f"{'' if field == '__all__' else field + ': '}{' '.join(problems)}")
    if not errors:
        messages.success(request, f"Model '{model.name}' saved.")
    return redirect("portal:model", model.pk)


@require_POST
@portal_page
def model_delete(request, pk):
    principal = request.principal
    model = get_visible_or_404(Model.objects.select_related("tenant"), principal, pk=pk)
    try:
        model_deletion.delete_model(principal, model)
    except Conflict as exc:  # services not stopped use it: they are named
        messages.error(request, str(exc.detail))
        return redirect("portal:model", model.pk)
    messages.success(request, f"Model '{model.name}' deleted.")
    return redirect("portal:models")
