import orjson
from rest_framework.renderers import JSONRenderer


def _fallback(obj):
    # Decimal, lazy translation strings, ipaddress objects…: their text form.
    return str(obj)


class FastJSONRenderer(JSONRenderer):
    """DRF's JSON renderer on orjson: several times faster on large pages (node lists)."""

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None:
            return b""
        return orjson.dumps(data, default=_fallback, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_UTC_Z)
