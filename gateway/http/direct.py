"""The hot generation routes served straight from the ASGI stack, FastAPI's router left out.

FastAPI serves every route through its exception middleware, its per-request exit
stack, a linear match over every route, and a dependency solver that validates the
body field by field; on the whole-answer load of ``make bench-frontend`` that
machinery cost more of the event loop than the request's routing (issue 48).  A
route named here is answered by its handler, a plain ``Request -> Response``
coroutine that does what FastAPI would, in its order (the body read, the route's
dependencies, the body validated) and calls the route's own endpoint function: one
implementation, which FastAPI still declares (its OpenAPI schema, its docs).

It sits inside the user middleware (the request metrics, the body limit, which has
read and bounded the body already), so only the layers between them and the
endpoint are skipped, and it keeps what they did:

- ``scope["route"]`` is the route FastAPI would have matched (the request metrics
  label by its path);
- an exception the handler raises becomes the response the app's exception handler
  for it makes (looked up by the exception's class hierarchy, as Starlette's exception
  middleware does): the same error body in the API's format, the same status; one
  with no handler but the catch-all for ``Exception`` (a bug) is raised on, to the
  server-error middleware outside, which answers 500 with that handler and raises it
  to the server, as for any route;
- a response is sent as FastAPI would send it (the same ``Response`` objects).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from gateway.http.middleware import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class DirectRoutes:
    """Serve ``routes`` (``(method, path) -> handler``) without the router; everything
    else goes on to ``app``."""

    def __init__(self, app: ASGIApp, routes: Mapping[tuple[str, str], Handler]) -> None:
        self.app = app
        self._routes = dict(routes)
        self._declared: dict[tuple[str, str], BaseRoute | None] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = (scope.get("method", ""), scope.get("path", ""))
        handler = self._routes.get(key) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = self._route(scope["app"], key)
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as exc:
            on_error = _error_handler(scope["app"], exc)
            if on_error is None:
                raise
            response = await on_error(request, exc)
        await response(scope, receive, send)

    def _route(self, app: Any, key: tuple[str, str]) -> BaseRoute | None:
        """The route the router would have matched for ``key`` (found once)."""
        if key not in self._declared:
            self._declared[key] = next((r for r in app.router.routes if _declares(r, key)), None)
        return self._declared[key]


def _declares(route: BaseRoute, key: tuple[str, str]) -> bool:
    method, path = key
    return getattr(route, "path", None) == path and method in (getattr(route, "methods", ()) or ())


def _error_handler(app: Any, exc: Exception) -> ErrorHandler | None:
    """The app's handler for ``exc``: the first of its classes, most specific first, that
    has one, the catch-all for ``Exception`` aside (Starlette's exception middleware's
    lookup; the catch-all is the server-error middleware's)."""
    handlers: Mapping[Any, ErrorHandler] = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None
