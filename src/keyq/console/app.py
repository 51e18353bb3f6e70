"""``keyq console``'s web application: server-rendered pages over ``keyq.ops`` (the functions the
CLI calls), a live overview polled by a few lines of plain JavaScript, and one POST endpoint
for every action. ``keyq.console.guard`` stands in front of every request (who, CSRF, headers).

Blocking work (Redis, RabbitMQ) runs in Starlette's thread pool, one ``OperatorContext`` per
request; a broker that does not answer holds one of the pool's threads until its timeouts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from keyq.broker.connections import open_redis, redis_errors
from keyq.broker.errors import InvalidInput, KeyqError, ServiceUnavailable
from keyq.broker.naming import check_stream_name
from keyq.broker.settings import Settings
from keyq.console.access import Access
from keyq.console.actions import ACTIONS
from keyq.console.audit import AuditLog
from keyq.console.guard import Guard
from keyq.console.keys import key_picture, keys_with_prefix
from keyq.console.letters import letter, letters_page
from keyq.console.overview import Overview
from keyq.console.rendering import register_filters
from keyq.ops.context import OperatorContext, StreamNotKnown
from keyq.ops.control import stream_view
from keyq.ops.dead_letter_selection import LetterNotFound

HERE = Path(__file__).resolve().parent  # the source folder, also under a strict editable install
T = TypeVar("T")
NOT_FOUND = (StreamNotKnown, LetterNotFound)
MAX_PAGE = 10_000  # of dead letters: 500,000 deep; past it, filter by key or reason

log = logging.getLogger("keyq.console")


class Console:
    """The pages and the action endpoint, sharing the settings, access and one Redis client."""

    def __init__(self, settings: Settings, access: Access, streams: list[str]) -> None:
        self.settings = settings
        self.access = access
        self.redis = open_redis(settings)
        self.streams = streams
        self.overview = Overview(self.redis, settings.member_ttl_ms, streams)
        self.audit = AuditLog(self.redis)
        environment = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True
        )
        register_filters(environment)
        self.templates = Jinja2Templates(env=environment)

    # ---- helpers ------------------------------------------------------------------------------

    def page(self, request: Request, name: str, status: int = 200, **values: Any) -> Response:
        session = request.state.session
        values |= {
            "who": request.state.who,
            "read_only": self.access.read_only,
            "csrf": self.access.csrf_token(session),
            "done": request.query_params.get("done"),
            "failed": request.query_params.get("failed"),
            "here": _here(request),
        }
        return self.templates.TemplateResponse(request, name, values, status_code=status)

    async def on_stream(self, stream: str, work: Callable[[OperatorContext], T]) -> T:
        if self.streams and check_stream_name(stream) not in self.streams:
            raise StreamNotKnown(f"stream {stream} does not exist among the streams shown here")

        def run() -> T:
            with OperatorContext(stream, self.settings) as ctx:
                return work(ctx)

        return await run_in_threadpool(run)

    async def failure(self, request: Request, exc: Exception) -> Response:
        """Any page's keyq error, drawn on the error page (registered once for the app)."""
        assert isinstance(exc, KeyqError)
        status = 404 if isinstance(exc, NOT_FOUND) else 400
        if isinstance(exc, ServiceUnavailable):
            status = 503
        return self.page(request, "error.html", status=status, message=str(exc))

    # ---- pages --------------------------------------------------------------------------------

    async def on_redis(self, work: Callable[[], T]) -> T:
        def run() -> T:
            with redis_errors(self.settings.redis_url):
                return work()

        return await run_in_threadpool(run)

    async def overview_page(self, request: Request) -> Response:
        data = await self.on_redis(self.overview.read)
        return self.page(request, "overview.html", overview=data)

    async def overview_fragment(self, request: Request) -> Response:
        data = await self.on_redis(self.overview.read)
        return self.page(request, "overview_body.html", overview=data)

    async def stream_page(self, request: Request) -> Response:
        stream = request.path_params["stream"]
        shown, _policy = await self.on_stream(stream, stream_view)
        return self.page(request, "stream.html", stream=stream, view=shown)

    async def key_page(self, request: Request) -> Response:
        stream = request.path_params["stream"]
        key = request.query_params.get("key", "")
        prefix = request.query_params.get("prefix") == "1"
        if prefix:
            found, whole = await self.on_stream(stream, lambda ctx: keys_with_prefix(ctx, key))
            return self.page(
                request, "keys.html", stream=stream, prefix=key, found=found, whole=whole
            )
        picture = await self.on_stream(stream, lambda ctx: key_picture(ctx, key))
        return self.page(request, "key.html", stream=stream, key=key, picture=picture)

    async def letters_page(self, request: Request) -> Response:
        stream = request.path_params["stream"]
        query = request.query_params
        key, reason = query.get("key") or None, query.get("reason") or None
        try:
            page = min(max(0, int(query.get("page", "0"))), MAX_PAGE)
        except ValueError:
            raise InvalidInput("page must be a number") from None
        listed = await self.on_stream(
            stream, lambda ctx: letters_page(ctx, key=key, reason=reason, page=page)
        )
        return self.page(
            request, "letters.html", stream=stream, key=key, reason=reason, listed=listed
        )

    async def letter_page(self, request: Request) -> Response:
        stream = request.path_params["stream"]
        query = request.query_params
        letter_id, key = query.get("id", ""), query.get("key") or None
        whole = query.get("whole") == "1"
        found = await self.on_stream(stream, lambda ctx: letter(ctx, letter_id, key, whole=whole))
        return self.page(request, "letter.html", stream=stream, letter=found)

    async def audit_page(self, request: Request) -> Response:
        entries = await self.on_redis(self.audit.newest)
        return self.page(request, "audit.html", entries=entries)

    # ---- the one endpoint that changes things ---------------------------------------------------

    async def act(self, request: Request) -> Response:
        """Run an action after the guard's checks and the CSRF token's, audit it, and send the
        operator back where they were with its outcome."""
        stream, name = request.path_params["stream"], request.path_params["action"]
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        if not self.access.csrf_valid(request.state.session, form.get("csrf")):
            return PlainTextResponse("forbidden: the form's CSRF token is missing or wrong", 403)
        action = ACTIONS.get(name)
        if action is None:
            return PlainTextResponse(f"no action {name!r}", 404)
        back = _local_path(form.get("next")) or f"/streams/{stream}"
        target = form.get(action.target_field, "")
        try:
            outcome = await self.on_stream(stream, lambda ctx: action.run(ctx, form))
            flag = "done"
        except KeyqError as exc:
            outcome, flag = f"{type(exc).__name__}: {exc}", "failed"
        except Exception as exc:  # audited all the same: it may have changed something
            log.exception("console action %s on %s failed", name, stream)
            outcome, flag = f"unexpected {type(exc).__name__}; see the console's log", "failed"
        await self.on_redis(
            lambda: self.audit.record(
                who=request.state.who,
                address=request.client.host if request.client else "",
                action=name,
                stream=stream,
                target=target,
                outcome=outcome,
            )
        )
        separator = "&" if "?" in back else "?"
        return RedirectResponse(back + separator + urlencode({flag: outcome}), status_code=303)

    async def health(self, _request: Request) -> Response:
        return PlainTextResponse("ok")


def _here(request: Request) -> str:
    """This page's path and query, without the last action's outcome: where a form returns."""
    kept = [(k, v) for k, v in request.query_params.multi_items() if k not in ("done", "failed")]
    return request.url.path + (f"?{urlencode(kept)}" if kept else "")


def _local_path(value: str | None) -> str | None:
    """A path on this console to go back to; anything else (another site) is not followed."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return None
    return value


def create_app(settings: Settings, access: Access, streams: list[str] | None = None) -> Starlette:
    console = Console(settings, access, streams or [])
    routes = [
        Route("/", console.overview_page),
        Route("/fragments/overview", console.overview_fragment),
        Route("/audit", console.audit_page),
        Route("/healthz", console.health),
        Route("/streams/{stream}", console.stream_page),
        Route("/streams/{stream}/key", console.key_page),
        Route("/streams/{stream}/dead-letters", console.letters_page),
        Route("/streams/{stream}/dead-letters/letter", console.letter_page),
        Route("/streams/{stream}/actions/{action}", console.act, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        console.redis.close()

    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={KeyqError: console.failure}
    )
    app.add_middleware(Guard, access=access)
    return app
