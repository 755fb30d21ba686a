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


class EventStreamRenderer(FastJSONRenderer):
    """Lets a view that streams `text/event-stream` (a log's follow) be asked for it by
    an Accept header, as EventSource does; what such a view renders itself (an error
    before the stream starts) is JSON."""

    media_type = "text/event-stream"
    format = "event-stream"
    charset = None
