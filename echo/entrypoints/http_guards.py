"""What the server checks of every HTTP request before a route sees it, and the watch that ends
a whole (non-streamed) response's work when its client goes away.

`HTTPGuard` is plain ASGI rather than FastAPI's `@app.middleware("http")`: it must count the
bytes actually received (a chunked upload has no Content-Length to trust), and it must leave
the receive channel to the route, which listens on it for the client's disconnect.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")


class HTTPGuard:
    """API-key check for /v1 routes, then the body read whole within max_request_bytes (413
    past it, without calling the app) and replayed to the app."""

    def __init__(self, app, error_response: Callable[..., Response], api_key: str | None,
                 max_request_bytes: int):
        self.app, self.error_response = app, error_response
        self.api_key, self.max_request_bytes = api_key, max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1") and \
                headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
            return await self.error_response(401, "invalid API key",
                                             kind="authentication_error")(scope, receive, send)
        too_large = self.error_response(413, f"request body over {self.max_request_bytes} bytes")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_request_bytes:
            return await too_large(scope, receive, send)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before it finished sending: nobody to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_request_bytes:
                return await too_large(scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from now on: the client's disconnect

        await self.app(scope, replay, send)


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnected once the client has gone, with `work`
    cancelled: its generators abort their requests in the engine, as a streamed response's
    do when Starlette cancels them."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()
