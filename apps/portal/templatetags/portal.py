from django import template
from django.utils.http import urlencode

register = template.Library()

DASH = "—"


@register.filter
def dash(value):
    """Missing data is "—", never 0."""
    return DASH if value is None or value == "" else value


def missing(value) -> bool:
    """None, or "" (what a template gives for a variable that does not resolve)."""
    return value is None or value == ""


@register.filter
def pct(value, digits=0):
    if missing(value):
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
    """ok / warn / high for threshold colouring: "60,80" is amber above 60 and red above
    80; a single limit ("80") is red above it and no amber."""
    if missing(value):
        return "none"
    *warn, high = (float(x) for x in str(limits).split(","))
    return "high" if value > high else "warn" if warn and value > warn[0] else "ok"


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


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


@register.filter
def bytes_iec(value):
    """1536 -> "1.5 KiB"; missing data is "—". (server_panel.js's bytes() says the same.)"""
    if missing(value):
        return DASH
    value, unit = float(value), 0
    while abs(value) >= 1024 and unit < len(BYTE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.0f} {BYTE_UNITS[unit]}" if unit == 0 else f"{value:.1f} {BYTE_UNITS[unit]}"


@register.filter
def byte_rate(value):
    return DASH if missing(value) else f"{bytes_iec(value)}/s"


@register.filter
def duration(seconds):
    """Seconds as "3 d 4 h 12 min" (from the largest part that is not 0; under a minute "42 s")."""
    if missing(seconds):
        return DASH
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    parts = [(seconds // 86400, "d"), (seconds % 86400 // 3600, "h"), (seconds % 3600 // 60, "min")]
    while parts and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n} {unit}" for n, unit in parts)
