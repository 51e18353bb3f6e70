"""In front of every request to the console (``keyq.console.access`` says why each check):

- the health check and static files pass as they are;
- an open console (no credentials set, loopback only) answers only requests addressed to a
  loopback name, so a site whose name is rebound to 127.0.0.1 cannot read it;
- a guarded one answers 401 without credentials;
- a change (POST) is refused on a read-only console, and from another site's page;
- every response carries headers that forbid inline scripts, framing and caching, and a
  session cookie is set where there was none (the endpoint checks its CSRF token).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp

from keyq.console.access import SESSION_COOKIE, Access, is_loopback, new_session

OPEN_PATHS = ("/healthz", "/static/")
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class Guard(BaseHTTPMiddleware):
    def __init__(self, app: ASGIApp, access: Access) -> None:
        super().__init__(app)
        self.access = access

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.url.path == "/healthz" or request.url.path.startswith("/static/"):
            return await call_next(request)
        refused = self._refusal(request)
        if refused is not None:
            return _secured(refused)
        session = request.cookies.get(SESSION_COOKIE)
        request.state.session = session or new_session()
        response = await call_next(request)
        if session is None:
            response.set_cookie(
                SESSION_COOKIE,
                request.state.session,
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        return _secured(response)

    def _refusal(self, request: Request) -> Response | None:
        access = self.access
        if not access.guarded and not is_loopback(request.url.hostname or ""):
            return PlainTextResponse("forbidden: an open console answers loopback names only", 403)
        who = access.who(request.headers.get("authorization"))
        if who is None:
            return PlainTextResponse(
                "unauthorized: this console needs its token or password",
                401,
                headers={"WWW-Authenticate": 'Basic realm="keyq console", charset="UTF-8"'},
            )
        request.state.who = who
        if request.method not in ("GET", "HEAD"):
            if access.read_only:
                return PlainTextResponse("forbidden: this console is read-only", 403)
            if not _same_origin(request):
                return PlainTextResponse("forbidden: the form comes from another site", 403)
        return None


def _same_origin(request: Request) -> bool:
    """A browser's POST says where its page came from; it must be this console."""
    origin = request.headers.get("origin")
    if origin is None:
        return True  # not a browser's cross-site form (browsers send Origin on those POSTs)
    if origin == "null":
        return False
    parts = urlsplit(origin)
    return parts.netloc == request.headers.get("host", "")


def _secured(response: Response) -> Response:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response
