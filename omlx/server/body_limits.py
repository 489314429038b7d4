"""Bounds on request bodies, checked before any route parses them: a body over
`MAX_BODY_BYTES` gets a 413, JSON nested deeper than `MAX_JSON_DEPTH` a 400, both in the
route's error dialect.

Python's JSON parser, pydantic and the JSON-schema checks all recurse: a 10,000-deep array
would raise RecursionError (a 500) in whichever of them met it first.
"""

from __future__ import annotations

import re

import numpy as np
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omlx.server.errors import error_response

MAX_BODY_BYTES = 64 << 20
MAX_JSON_DEPTH = 100
DRAIN_BYTES = 1 << 30  # a larger body is answered without being read to its end
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_WITH_BODY = ("POST", "PUT", "PATCH", "DELETE")


def json_depth(body: bytes) -> int:
    """How deeply `body` nests arrays and objects (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


class BodyLimits:
    """ASGI middleware: reads a body whole (up to the limit), checks it, then hands it on;
    later `receive` calls go to the server, so routes still hear a client disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_JSON_DEPTH):
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        declared = request.headers.get("content-length", "")
        chunks: list[bytes] = []
        read, more = 0, True
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        while more and read <= DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk, more = message.get("body", b""), message.get("more_body", False)
            read += len(chunk)
            too_large = too_large or read > self.max_bytes
            if not too_large:  # else the rest is read and dropped, so that the client hears the 413
                chunks.append(chunk)
        if too_large:
            await self._refuse(scope, receive, send, 413, self._too_large())
            return
        body = b"".join(chunks)
        if body and _may_be_json(request.headers.get("content-type", "")):
            depth = json_depth(body)
            if depth > self.max_depth:
                message = f"The JSON body is nested {depth} levels deep; at most {self.max_depth} are accepted."
                await self._refuse(scope, receive, send, 400, message)
                return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return f"The request body is larger than {self.max_bytes >> 20} MiB."

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
        response = error_response(Request(scope), status, message, code="request_too_large" if status == 413 else None)
        await response(scope, receive, send)


def _may_be_json(content_type: str) -> bool:
    """Whether a route may parse the body as JSON: no content type, or a JSON one (FastAPI
    hands any other body to its route as bytes, e.g. a document to convert)."""
    kind = content_type.split(";")[0].strip().lower()
    return not kind or kind == "application/json" or kind.endswith("+json")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
