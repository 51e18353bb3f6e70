"""In front of every request to the console (``keyq.console.access`` says why each check):

- the health check and static files pass as they are;
- a console answers only requests addressed to a loopback name or, guarded, to a name it
  was given (``--allowed-host``), so a site whose name is rebound to its address cannot read
  it; an open one refuses requests that came through a proxy;
- a guarded one answers 401 without credentials;
- another site's page may link to the console but not load it inside itself (``Sec-Fetch-*``);
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

from keyq.console.access import SESSION_COOKIE, Access, new_session

FORWARDED = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip")
# Reads that change something outside Redis' records (a walk of the dead-letter queue under
# its lock): only from the console's own pages, never from a link elsewhere.
OWN_PAGES_ONLY = ("whole",)
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
        if not access.answers(request.url.hostname or ""):
            return PlainTextResponse(
                "forbidden: this console does not answer to that name (--allowed-host)", 403
            )
        if not access.guarded and any(name in request.headers for name in FORWARDED):
            return PlainTextResponse(
                "forbidden: behind a proxy the console needs KEYQ_CONSOLE_TOKEN or "
                "KEYQ_CONSOLE_BASIC_AUTH",
                403,
            )
        if not _fetched_by_this_site(request):
            return PlainTextResponse("forbidden: another site's page asked for this", 403)
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
                return PlainTextResponse(
                    "forbidden: the form comes from another site; reload the console's page", 403
                )
        return None


def _fetched_by_this_site(request: Request) -> bool:
    """What a browser says of who asked (``Sec-Fetch-*``): another site may link to a page
    (a top-level navigation), never load one as an image, a script or a fetch, nor link to a
    read that walks the dead-letter queue. Clients that send no such header pass."""
    site = request.headers.get("sec-fetch-site")
    if site is None or site in ("same-origin", "none"):
        return True
    if any(name in request.query_params for name in OWN_PAGES_ONLY):
        return False
    return request.method == "GET" and request.headers.get("sec-fetch-mode") == "navigate"


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
