"""Energy and carbon figures on the pages (docs/energy.md): missing data is "—", never 0."""

from django import template

from apps.portal.templatetags.portal import DASH, missing

register = template.Library()


@register.filter
def kwh(value, digits=3):
    """1.2345 -> "1.235 kWh"."""
    return DASH if missing(value) else f"{float(value):.{int(digits)}f} kWh"


@register.filter
def watts(value):
    return DASH if missing(value) else f"{float(value):.0f} W"


@register.filter
def co2e(grams):
    """Grams of CO2e in the unit that reads best: "840 g", "12.5 kg", "3.20 t"."""
    if missing(grams):
        return DASH
    grams = float(grams)
    if abs(grams) >= 1_000_000:
        return f"{grams / 1_000_000:.2f} t CO₂e"
    if abs(grams) >= 1_000:
        return f"{grams / 1_000:.1f} kg CO₂e"
    return f"{grams:.0f} g CO₂e"
