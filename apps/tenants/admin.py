"""Operators' admin for tenancy. Every change goes through services.py, like the API."""

from django import forms
from django.contrib import admin, messages

from apps.core.admin_tools import DeleteThroughServiceMixin, operator
from apps.tasks.choices import ACTIVE
from apps.tasks.models import Task
from apps.tenants import services
from apps.tenants.api.serializers import idle_problem, slug_validator
from apps.tenants.models import ApiKey, Membership, Tenant, TenantGroup
from apps.tenants.selectors import loses_last_admin


class TenantForm(forms.ModelForm):
    slug = forms.CharField(validators=[slug_validator], max_length=40)

    class Meta:
        model = Tenant
        fields = [
            "name",
            "slug",
            "max_gpus",
            "max_gpu_memory_mb",
            "max_concurrent_tasks",
            "interactive_idle_minutes",
            "interactive_idle_minutes_max",
        ]

    def clean_name(self):
        name = self.cleaned_data["name"].strip()
        if Tenant.objects.exclude(pk=self.instance.pk).filter(name__iexact=name).exists():
            raise forms.ValidationError("A tenant with this name already exists.")
        return name

    def clean(self):
        cleaned = super().clean()
        problem = idle_problem(cleaned.get("interactive_idle_minutes"), cleaned.get("interactive_idle_minutes_max"))
        if problem:
            self.add_error("interactive_idle_minutes", problem)
        return cleaned

    def clean_slug(self):
        slug = self.cleaned_data["slug"]
        if self.instance.pk and slug != self.instance.slug:
            raise forms.ValidationError("The slug names the tenant's schema and cannot change.")
        if not self.instance.pk and Tenant.objects.filter(slug=slug).exists():
            raise forms.ValidationError("A tenant with this slug already exists.")
        return slug


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    fields = ["user", "role", "created_at"]
    readonly_fields = ["user", "role", "created_at"]
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Tenant)
class TenantAdmin(DeleteThroughServiceMixin, admin.ModelAdmin):
    form = TenantForm
    list_display = ["name", "slug", "schema_name", "max_gpus", "max_concurrent_tasks", "created_at"]
    search_fields = ["name", "slug"]
    readonly_fields = ["schema_name", "created_at"]
    inlines = [MembershipInline]

    def save_model(self, request, obj, form, change):
        if change:
            fields = {name: form.cleaned_data[name] for name in form.changed_data if name != "slug"}
            services.update_tenant(obj, principal=operator(request), **fields)
            return
        created = services.create_tenant(
            name=obj.name,
            slug=obj.slug,
            principal=operator(request),
            **{field: form.cleaned_data.get(field) for field in services.LIMIT_FIELDS},
        )
        obj.pk, obj.schema_name, obj.created_at = created.pk, created.schema_name, created.created_at
        obj._state.adding, obj._state.db = False, created._state.db

    def delete_through_service(self, request, obj):
        services.delete_tenant(obj)

    def delete_view(self, request, object_id, extra_context=None):
        tenant = self.get_object(request, object_id)
        if (
            request.method == "GET"
            and tenant is not None
            and Task.objects.filter(tenant=tenant, status__in=ACTIVE).exists()
        ):
            self.message_user(
                request, f"Tenant '{tenant.slug}' has active tasks; stop them before deleting it.", messages.WARNING
            )
        return super().delete_view(request, object_id, extra_context)


class MembershipForm(forms.ModelForm):
    class Meta:
        model = Membership
        fields = ["user", "tenant", "role"]

    def clean(self):
        data = super().clean()
        if self.instance.pk:
            if loses_last_admin(self.instance, data.get("role")):
                raise forms.ValidationError("This is the tenant's last admin; make someone else admin first.")
        elif Membership.objects.filter(user=data.get("user"), tenant=data.get("tenant")).exists():
            raise forms.ValidationError("This user is already a member of this tenant.")
        return data


@admin.register(Membership)
class MembershipAdmin(DeleteThroughServiceMixin, admin.ModelAdmin):
    form = MembershipForm
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]
    autocomplete_fields = ["user", "tenant"]

    def get_readonly_fields(self, request, obj=None):
        return ["user", "tenant"] if obj else []

    def save_model(self, request, obj, form, change):
        if change:
            services.change_member_role(obj, obj.role, principal=operator(request))
        else:
            added = services.add_member(
                obj.tenant, username=obj.user.username, role=obj.role, principal=operator(request)
            )
            obj.pk, obj._state.adding = added.membership.pk, False

    def delete_through_service(self, request, obj):
        services.remove_member(obj, principal=operator(request))


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "display_prefix",
        "scope",
        "tenant",
        "user",
        "role",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["scope", "tenant"]
    search_fields = ["name", "display_prefix", "user__username"]
    readonly_fields = [f.name for f in ApiKey._meta.fields if f.name != "key_hash"]
    exclude = ["key_hash"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False  # keys are shown once: issue them through the API or the portal

    def has_delete_permission(self, request, obj=None):
        return False  # revoke, so that the record of the key stays

    @admin.action(description="Revoke selected keys")
    def revoke(self, request, queryset):
        for api_key in queryset:
            services.revoke_key(api_key, principal=operator(request))
        self.message_user(request, f"Revoked {queryset.count()} key(s).", messages.SUCCESS)


@admin.register(TenantGroup)
class TenantGroupAdmin(admin.ModelAdmin):
    """Tenants in one group may share physical GPUs. Saved through services.save_group,
    as the API saves them."""

    list_display = ["name", "description", "members", "created_at"]
    filter_horizontal = ["tenants"]
    search_fields = ["name"]

    @admin.display(description="tenants")
    def members(self, group):
        return ", ".join(tenant.slug for tenant in group.tenants.all())

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("tenants")

    def save_model(self, request, obj, form, change):
        saved = services.save_group(
            obj if change else None,
            name=form.cleaned_data["name"],
            description=form.cleaned_data["description"],
            tenants=form.cleaned_data["tenants"],
        )
        obj.pk, obj.created_at, obj._state.adding, obj._state.db = saved.pk, saved.created_at, False, saved._state.db

    def save_related(self, request, form, formsets, change):
        pass  # the tenants were set by save_group
