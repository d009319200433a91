"""The gate over HTTP (FastAPI, run by uvicorn). Routes are thin: read the body (bounded), parse it, call `Gate`,
and map a `GovtrainError`'s code to its status (`STATUS`). Every refusal is ``{"ok": false, "code", "detail"}``.

    GET  /v1/info       what is served: the release, its classes, its taint (no envelope needed)
    POST /v1/classify   {"texts": [...]} -> labels and logits            (a sequence-classification release)
    POST /v1/generate   {"prompt": ..., "max_new_tokens": n} -> text     (a causal-LM release)
    POST /v1/split      a `govtrain.inference` SplitRequest -> SplitResponse (a classifier with a pooled head)

Every POST needs a rights envelope in the `Govtrain-Rights` header (`rights.py`).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from typing import Any, Iterator

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from govtrain.errors import Code, GovtrainError, ServeError
from govtrain.inference.server import HTTP_STATUS as SPLIT_STATUS
from govtrain.policy.config import first_error
from govtrain.serve.rights import HEADER
from govtrain.serve.service import Gate

# The HTTP status of every code a request can be refused with; any other code is a 500.
STATUS: dict[Code, int] = {
    Code.BAD_REQUEST: 400,
    # the envelope: missing, unreadable, forged, from an unknown issuer, out of its window (RFC 9110 §15.5.2)
    **{code: 401 for code in (
        Code.RIGHTS_MISSING, Code.RIGHTS_UNREADABLE, Code.TOO_LARGE, Code.MALFORMED_CBOR, Code.TRAILING_BYTES,
        Code.INDEFINITE_LENGTH, Code.NON_CANONICAL, Code.DUPLICATE_KEY, Code.FLOAT_FORBIDDEN, Code.FORBIDDEN_TAG,
        Code.TOO_DEEP, Code.INVALID_UTF8, Code.UNKNOWN_FIELD, Code.MISSING_FIELD, Code.WRONG_TYPE, Code.BAD_VALUE,
        Code.UNSUPPORTED_VERSION, Code.NOT_COSE_SIGN1, Code.BAD_COSE_STRUCTURE, Code.BAD_ALGORITHM, Code.BAD_HEADER,
        Code.DUPLICATE_HEADER, Code.UNKNOWN_CRITICAL, Code.MISSING_KID, Code.BAD_SIGNATURE, Code.UNKNOWN_KEY,
        Code.BAD_WINDOW, Code.NOT_YET_VALID, Code.EXPIRED, Code.WINDOW_TOO_LONG, Code.ISSUED_IN_FUTURE)},
    # a valid envelope that does not permit this (RFC 9110 §15.5.4)
    **{code: 403 for code in (Code.WRONG_AUDIENCE, Code.KEY_NOT_AUTHORIZED, Code.CLASS_NOT_PERMITTED,
                              Code.SESSION_NOT_COVERED)},
    Code.NOT_SERVED: 404,
    Code.METHOD_NOT_ALLOWED: 405,
    Code.RELEASE_TAINTED: 409,
    Code.REQUEST_TOO_LARGE: 413,
    **SPLIT_STATUS,  # split inference's own: 403 another's session, 422 its privacy terms or vector, 429 its budget
    Code.TAINT_UNKNOWN: 503,
}


def status_of(error: GovtrainError) -> int:
    return STATUS.get(error.code, 500)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ClassifyRequest(_Body):
    texts: list[str] = Field(min_length=1, description="the texts to classify")


class GenerateRequest(_Body):
    prompt: str = Field(description="the text to continue")
    max_new_tokens: int = Field(16, description="how many tokens to generate (greedy)")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(body: bytes, model: type[_Body]) -> Any:
    """`body` as `model`, or `bad_request` naming the first problem (NaN and Infinity are not JSON, and nesting
    past Python's recursion limit is not read: both refused)."""
    try:
        document = json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise ServeError(Code.BAD_REQUEST, f"the body is not JSON ({e})") from None
    except RecursionError:  # json.loads recurses once per nested array or object; the stack is no request's
        raise ServeError(Code.BAD_REQUEST, "the body nests too deep (send a flat JSON object)") from None
    try:
        return model.model_validate(document)
    except ValidationError as e:
        raise ServeError(Code.BAD_REQUEST, f"{first_error(e, 'the body')} (the body is a JSON object with "
                                           f"{', '.join(model.model_fields)})") from None


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body, refused with `request_too_large` as soon as it is known to exceed `limit` bytes (its
    Content-Length, or what has arrived of it), before the rest is read."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ServeError(Code.REQUEST_TOO_LARGE, f"a body of {declared} bytes; at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServeError(Code.REQUEST_TOO_LARGE, f"a body of over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(gate: Gate) -> Any:
    """The FastAPI app serving `gate`."""
    app = FastAPI(title="govtrain inference gate", docs_url=None, redoc_url=None, openapi_url=None)
    limit = gate.policy.max_body_bytes

    @app.exception_handler(GovtrainError)
    async def refused(request: Request, error: GovtrainError) -> JSONResponse:
        return JSONResponse(error.as_json(), status_code=status_of(error))

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, error: HTTPException) -> JSONResponse:
        # the router's own refusals, each with the code whose status `STATUS` gives it (one code, one status)
        code = {404: Code.NOT_SERVED, 405: Code.METHOD_NOT_ALLOWED}.get(error.status_code, Code.BAD_REQUEST)
        detail = f"{request.method} {request.url.path}: {error.detail}; the gate serves GET /v1/info and POST " \
                 "/v1/classify, /v1/generate, /v1/split"
        return JSONResponse({"ok": False, "code": code.value, "detail": detail}, status_code=STATUS[code],
                            headers=error.headers)  # a 405 names the methods the route answers (Allow)

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse({"ok": False, "code": "internal", "detail": f"{type(error).__name__}: the gate failed "
                                                                        "on this request; its log has the details"},
                            status_code=500)

    @app.get("/v1/info")
    async def info() -> JSONResponse:
        return JSONResponse(await run_in_threadpool(gate.info))

    @app.post("/v1/classify")
    async def classify(request: Request) -> JSONResponse:
        body = parse_body(await read_body(request, limit), ClassifyRequest)
        return JSONResponse(await run_in_threadpool(gate.classify, request.headers.get(HEADER), body.texts))

    @app.post("/v1/generate")
    async def generate(request: Request) -> JSONResponse:
        body = parse_body(await read_body(request, limit), GenerateRequest)
        return JSONResponse(await run_in_threadpool(gate.generate, request.headers.get(HEADER), body.prompt,
                                                    body.max_new_tokens))

    @app.post("/v1/split")
    async def split(request: Request) -> JSONResponse:
        body = await read_body(request, limit)
        answer, admission = await run_in_threadpool(gate.split, request.headers.get(HEADER), body)
        served = gate.served(admission)  # the body is the split client's SplitResponse; how it was served, here
        return JSONResponse(answer, headers={"Govtrain-Release": served["release"],
                                             "Govtrain-Disabled-Adapters": ",".join(served["disabled_adapters"]),
                                             "Govtrain-Withdrawn-At-Release": ",".join(served["withdrawn_at_release"])})

    return app


def uvicorn_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000) -> Any:
    """A uvicorn server for `app` (quiet: refusals are answers, not log lines)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=5))


@contextlib.contextmanager
def running(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` with uvicorn on a thread while the block runs (port 0: a free one); yields the base URL, and
    shuts the server down cleanly when the block ends."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, as uvicorn's own bind does; without it
    # every answer waits ~40 ms for the client's delayed ACK (headers and body are two writes)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn_server(app, host=host, port=sock.getsockname()[1])
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="govtrain-serve", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the uvicorn server stopped before it started")
            thread.join(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
