"""Every failure as an OpenAI-style error body: {"error": {message, type, param, code}},
or under /v1/messages as Anthropic's: {"type": "error", "error": {type, message}}.

Clients read the message and map the status to an exception class, so every path out of
the server, including FastAPI's own (422 validation errors, 404 routes), the middleware's
(401, 413) and unexpected exceptions, must produce their API's shape with the status it
would use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from pagellm.engine.async_engine import EngineDeadError, RequestFailedError
from pagellm.entrypoints.openai.json_text import JSONResponse
from pagellm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

Body = TypeVar("Body", bound=BaseModel)

logger = logging.getLogger(__name__)

# Segments pydantic adds to an error location for the branch of a union it tried; they
# are type names, not field names, so they do not belong in `param`.
_UNION_BRANCH_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_branch(part: str) -> bool:
    return part in _UNION_BRANCH_TAGS or "[" in part or part.startswith("function-")


class APIError(Exception):
    """An error with its HTTP status, raised anywhere while serving a request."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.details = details  # Anthropic's `error.details`, which its SDK acts on
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump(mode="json")

    def anthropic_body(self) -> dict[str, Any]:
        """The error as Anthropic's Messages API writes it (its SDK reads `error.type`)."""
        kind = _ANTHROPIC_TYPES.get(self.status,
                                    "api_error" if self.status >= 500 else self.type)
        error: dict[str, Any] = {"type": kind, "message": self.message}
        if self.details is not None:
            error["details"] = self.details
        return {"type": "error", "error": error}

    def response(self, headers: dict[str, str] | None = None, anthropic: bool = False
                 ) -> JSONResponse:
        return JSONResponse(self.anthropic_body() if anthropic else self.body(),
                            status_code=self.status, headers=headers)


# Anthropic's error types by status.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def route_path(scope: Scope) -> str:
    """The path the app routes a request by: without the prefix a proxy mounts the app
    under (--root-path), which the request's path may carry (as the router reads it)."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):]
    return path


def is_anthropic(scope: Scope) -> bool:
    """Whether a request's errors are written Anthropic's way: those of its Messages
    API, whose SDK reads that shape."""
    return route_path(scope).startswith("/v1/messages")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_path(loc: Sequence[int | str]) -> str | None:
    """`messages[0].role` from pydantic's ('messages', 0, 'role'), union branches dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_union_branch(part):
            break
        else:
            path += f".{part}" if path else part
    return path or None


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 OpenAI sends for a body it cannot use, from FastAPI's validation errors.

    Only the first error is reported (as OpenAI does), with the field it concerns.
    """
    first: dict[str, Any] = (dict(errors[0]) if errors
                             else {"type": "", "loc": (), "msg": "invalid request"})
    kind = first.get("type", "")
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if kind == "json_invalid":
        return bad_request("We could not parse the JSON body of your request: "
                           f"{first.get('ctx', {}).get('error', 'invalid JSON')}.",
                           code="invalid_json")
    param = _param_path(loc)
    if param is None:
        if kind == "missing":
            return bad_request("The request body is empty; expected a JSON object.")
        return bad_request("The request body must be a JSON object, sent with "
                           "Content-Type: application/json.")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"Invalid value for '{param}': {message}.", param=param,
                       code="invalid_value")


def validated(model: type[Body], data: Any) -> Body:
    """`data` read as the request body `model`, as FastAPI reads a route's: what it
    cannot take is the same 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors()) from error


def failure(error: BaseException) -> APIError:
    """The API error for a request that failed after it was queued."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, "The server is shutting down.")
    if isinstance(error, RequestFailedError):
        return APIError(500, f"The server failed this request: {error}")
    logger.error("request failed", exc_info=error)
    return APIError(500, "The server had an error while processing your request.")


async def _on_api_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, APIError)
    return error.response(anthropic=is_anthropic(request.scope))


async def _on_validation_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    return validation_error(error.errors()).response(anthropic=is_anthropic(request.scope))


async def _on_http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    message = error.detail if isinstance(error.detail, str) else str(error.detail)
    cause = error.__cause__
    if error.status_code == 400 and cause is not None:  # FastAPI could not read the body
        message = unreadable_body(cause) or message
    return APIError(error.status_code, message).response(
        headers=dict(error.headers) if error.headers else None,
        anthropic=is_anthropic(request.scope))


def unreadable_body(cause: BaseException) -> str | None:
    """What FastAPI's "There was an error parsing the body" was, in words a client can
    act on."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"We could not parse the JSON body of your request: it is not UTF-8 text "
                f"(byte {cause.start}); a compressed body (Content-Encoding) is not "
                "supported.")
    if isinstance(cause, RecursionError):
        return "We could not parse the JSON body of your request: it is nested too deeply."
    return None


async def _on_unexpected(request: Request, error: Exception) -> JSONResponse:
    logger.error("unhandled error while serving a request", exc_info=error)
    return APIError(500, "The server had an error while processing your request.").response(
        anthropic=is_anthropic(request.scope))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
