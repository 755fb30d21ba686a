"""One JSON shape for every error: {"error": {"code", "message", "fields"}}."""

from __future__ import annotations

from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.views import exception_handler as drf_exception_handler

from apps.core.error_codes import CoreErrorCode


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = CoreErrorCode.CONFLICT

    def __init__(self, message: str, code: str = CoreErrorCode.CONFLICT):
        super().__init__(message, code)


def error_body(code: str, message: str, fields: dict | None = None) -> dict:
    return {"error": {"code": code, "message": message, "fields": fields or {}}}


def _flatten(detail) -> list[str] | dict:
    if isinstance(detail, dict):
        return {key: _flatten(value) for key, value in detail.items()}
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return [str(item) for item in detail]
        return [_flatten(item) for item in detail]
    return [str(detail)]


def _validation_body(exc: exceptions.ValidationError) -> dict:
    detail = exc.detail
    if not isinstance(detail, dict):
        return error_body(CoreErrorCode.INVALID, " ".join(_flatten(detail)) or "Invalid input.")
    fields = _flatten(detail)
    non_field = fields.pop("non_field_errors", None)
    unknown = sorted(
        name
        for name, errors in detail.items()
        if isinstance(errors, list) and any(getattr(e, "code", None) == CoreErrorCode.UNKNOWN_FIELD for e in errors)
    )
    if unknown:
        message = "Unknown field(s): " + ", ".join(unknown) + "."
    elif non_field:
        message = " ".join(non_field)
    else:
        message = "Invalid input: " + ", ".join(sorted(fields)) + "."
    return error_body(CoreErrorCode.INVALID, message, fields)


def exception_handler(exc, context):
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = _validation_body(exc)
        return response
    code = exc.get_codes() if isinstance(exc, exceptions.APIException) else CoreErrorCode.ERROR
    if not isinstance(code, str):
        code = CoreErrorCode.ERROR
    message = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
    # Http404 (get_visible_or_404) as well: the same words whether the row is absent or
    # outside the caller's scope, never the model's name
    if isinstance(exc, (exceptions.NotFound, Http404)) or getattr(exc, "status_code", None) == 404:
        code, message = CoreErrorCode.NOT_FOUND, "Not found."
    response.data = error_body(code, str(message))
    return response


def _is_api_path(path: str) -> bool:
    return path.startswith(("/api/", "/v1/"))


def not_found(request, exception=None):
    if _is_api_path(request.path):
        return JsonResponse(error_body(CoreErrorCode.NOT_FOUND, "Not found."), status=404)
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def server_error(request):
    if _is_api_path(request.path):
        return JsonResponse(error_body(CoreErrorCode.SERVER_ERROR, "Internal server error."), status=500)
    from django.views.defaults import server_error as html_server_error

    return html_server_error(request)
