"""Every failure answered in OpenAI's error shape, `{"error": {message, type, param, code}}`,
with a 4xx status for anything the client can fix; never a traceback or a file path."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ...errors import InputError
from .protocol import ErrorBody, ErrorResponse

log = logging.getLogger("glassformer.serving.api")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_error", 504: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def payload(self) -> dict:
        body = ErrorBody(message=self.message, type=TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=body).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), self.status, headers=self.headers)


def from_input(error: InputError, fields: Mapping[str, str] | None = None) -> APIError:
    """400 for a mistake in the request, `param` and `code` taken from the error's data;
    `fields`: what the request calls a field the library names otherwise."""
    param = (fields or {}).get(error.field, error.field)
    return APIError(400, str(error), param, error.code)


def from_validation(error: ValidationError) -> APIError:
    """The first problem pydantic found, named by its field path. Where a field may take several
    types, the member the value has the type of explains the problem best."""
    found = error.errors(include_url=False)
    first = found[0]
    loc = _path(first)
    first = next((e for e in found if _path(e)[: len(loc)] == loc and not e["type"].endswith("_type")), first)
    param = ".".join(loc) or None
    kind = first["type"]
    if kind == "json_invalid":
        if _lone_surrogate(first.get("input")):
            return APIError(400, "the body's text holds an unpaired surrogate escape (\\ud800-\\udfff "
                            "alone): valid JSON, but no Unicode text; send the character's pair",
                            code="invalid_json")
        return APIError(400, f"the body is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')})",
                        code="invalid_json")
    if kind == "model_type" and loc:  # a nested object sent as null, a list, a number...
        return APIError(400, f"{param}: must be a JSON object", param, "invalid_type")
    if kind == "model_type" or (kind.endswith("_type") and not loc):
        return APIError(400, "the body must be a JSON object", code="invalid_type")
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unknown field", param, "unknown_field")
    if kind == "missing":
        return APIError(400, f"{param}: required", param, "missing_field")
    cause = first.get("ctx", {}).get("error")
    if not loc and isinstance(cause, InputError):  # a check across fields names its field itself
        return from_input(cause)
    message = first["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param, "invalid_value")


def _path(error: dict) -> list[str]:
    return [str(p) for p in error["loc"] if not _is_union_tag(p)]


def _is_union_tag(part) -> bool:
    """pydantic names the union member it tried (`str`, `list[int]`, `function-after[...]`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part.startswith("constrained-"))


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return APIError(400, str(error.errors()[0].get("msg", "invalid request"))).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        messages = {404: f"{request.url.path}: no such route", 405: f"{request.method}: not allowed here"}
        return APIError(error.status_code, messages.get(error.status_code, str(error.detail))).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        # the error goes on to the HTTP server, which closes the connection after this answer
        return APIError(500, "internal error; see the server's log", code="internal_error",
                        headers={"Connection": "close"}).response()


def _lone_surrogate(body: object) -> bool:
    """Whether a body that pydantic's parser refused is JSON holding a lone surrogate escape
    (Python's parser takes it; no UTF-8 text can hold it)."""
    if not isinstance(body, (bytes, str)):
        return False
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
