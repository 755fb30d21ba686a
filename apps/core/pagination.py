"""The one pagination convention of every API list: `?limit=` and `?offset=`, answered
with `{"count", "next", "previous", "results"}` (the spec's paging; docs/api.md, "Pagination").

A limit outside 1–500 or a negative offset is refused with 400 naming the parameter, as
any other bad query parameter is; DRF's own class would quietly clamp or ignore it."""

from __future__ import annotations

from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination

from apps.core.serializers import StrictSerializer

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
PAGE_PARAMS = ("limit", "offset")  # the query parameters the paginator reads, not filters
LIMIT_HELP = f"Page size, 1–{MAX_LIMIT} (default {DEFAULT_LIMIT}); outside that range: 400."
OFFSET_HELP = "How many rows to skip (default 0). An offset past the end gives an empty `results`."


class PageQuerySerializer(StrictSerializer):
    """The paging parameters. A list's own query serializer inherits them, so its strict
    check knows them and its schema shows them once."""

    limit = serializers.IntegerField(min_value=1, max_value=MAX_LIMIT, required=False, help_text=LIMIT_HELP)
    offset = serializers.IntegerField(min_value=0, required=False, help_text=OFFSET_HELP)


class Pagination(LimitOffsetPagination):
    default_limit = DEFAULT_LIMIT
    max_limit = MAX_LIMIT

    def paging(self, request) -> dict:
        raw = {name: request.query_params[name] for name in PAGE_PARAMS if name in request.query_params}
        checked = PageQuerySerializer(data=raw)
        checked.is_valid(raise_exception=True)
        return checked.validated_data

    def get_limit(self, request):
        return self.paging(request).get(self.limit_query_param, self.default_limit)

    def get_offset(self, request):
        return self.paging(request).get(self.offset_query_param, 0)

    def get_schema_operation_parameters(self, view):
        """The schema of a list without its own query serializer says what PageQuerySerializer checks."""
        bounds = {
            self.limit_query_param: ({"minimum": 1, "maximum": MAX_LIMIT}, LIMIT_HELP),
            self.offset_query_param: ({"minimum": 0}, OFFSET_HELP),
        }
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            extra, text = bounds[parameter["name"]]
            parameter["schema"] |= extra
            parameter["description"] = text
        return parameters

    def window(self, request) -> tuple[int, int]:
        """For a list that slices its rows itself (the node list): this request's limit
        and offset. Set `count` to the total before `get_paginated_response`."""
        self.request = request
        self.limit, self.offset = self.get_limit(request), self.get_offset(request)
        return self.limit, self.offset
