from django import template
from django.utils.http import urlencode

register = template.Library()

DASH = "—"


@register.filter
def dash(value):
    """Missing data is "—", never 0."""
    return DASH if value is None or value == "" else value


@register.filter
def pct(value, digits=0):
    if value is None:
        return DASH
    return f"{float(value):.{int(digits)}f}%"


@register.filter
def mib_as_gib(value):
    if value is None:
        return DASH
    return f"{value / 1024:.1f} GiB"


@register.filter
def get(mapping, key):
    return (mapping or {}).get(key)


@register.filter
def level(value, limits="60,80"):
    """ok / warn / high for threshold colouring (e.g. 60 and 80 percent)."""
    if value is None:
        return "none"
    warn, high = (float(x) for x in str(limits).split(","))
    return "high" if value > high else "warn" if value > warn else "ok"


@register.simple_tag(takes_context=True)
def query(context, **changes):
    """The current query string with some parameters changed (None or "" removes one):
    pagination and filter links keep the other filters."""
    params = context["request"].GET.copy()
    for key, value in changes.items():
        if value is None or value == "":
            params.pop(key, None)
        else:
            params[key] = value
    encoded = urlencode(sorted((k, v) for k in params for v in params.getlist(k)))
    return "?" + encoded if encoded else "?"
