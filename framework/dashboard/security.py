"""The dashboard's guard: who may see it, who may change anything, and the headers every page carries.

* With a token, every request must carry it: ``Authorization: Bearer <token>``, or the cookie the
  dashboard sets when a browser opens any page with ``?token=<token>`` (HttpOnly, SameSite=Strict).
  Without one, only loopback clients are served (a request from elsewhere is refused), and the
  command refuses to listen off loopback at all.
* State-changing requests are POST only, and only when actions are enabled; each must come from the
  dashboard's own pages (``Origin`` or ``Referer`` of this host, no cross-site ``Sec-Fetch-Site``)
  and carry the CSRF token of its form (an HMAC of the caller's identity under a per-process key).
* Every response carries a strict Content-Security-Policy (scripts and styles from this origin
  only, no inline script), ``X-Frame-Options: DENY``, ``nosniff`` and ``no-referrer``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from urllib.parse import parse_qs, urlsplit

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["COOKIE", "CSP", "Guard", "form_data", "is_loopback"]

COOKIE = "framework_dashboard"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine only."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def form_data(request: Request) -> dict[str, list[str]]:
    """The urlencoded form of a POST (no multipart: the dashboard's forms send none), read once."""
    cached = getattr(request.state, "form", None)
    if cached is None:
        if len(await request.body()) > 8 * 2**20:
            raise ValueError("form too large")
        cached = parse_qs((await request.body()).decode(errors="replace"), keep_blank_values=True)
        request.state.form = cached
    return dict(cached)


class Guard:
    """ASGI middleware applying the rules of the module docstring to every HTTP request."""

    def __init__(self, app: ASGIApp, *, token: str | None, actions: bool) -> None:
        self.app = app
        self.token = token
        self.actions = actions
        self.key = secrets.token_bytes(32)
        self._cookie = hmac.new(self.key, (token or "").encode(), hashlib.sha256).hexdigest()

    def who(self, request: Request) -> str:
        """The caller as the audit log names it: the token's id (a hash prefix) and the remote address."""
        addr = request.client.host if request.client else "?"
        if self.token is None:
            return f"anonymous@{addr}"
        return f"token:{hashlib.sha256(self.token.encode()).hexdigest()[:8]}@{addr}"

    def csrf(self, request: Request) -> str:
        """The CSRF token forms of this caller carry."""
        return hmac.new(self.key, b"csrf|" + self.who(request).split("@")[0].encode(), hashlib.sha256).hexdigest()

    def _authorized(self, request: Request) -> bool:
        if self.token is None:
            return is_loopback(request.client.host if request.client else None)
        auth = request.headers.get("authorization", "")
        if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), self.token.encode()):
            return True
        return hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), self._cookie.encode())

    def _same_origin(self, request: Request) -> bool:
        if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            return False
        source = request.headers.get("origin") or request.headers.get("referer")
        if not source:
            return False
        parts = urlsplit(source)
        return f"{parts.scheme}://{parts.netloc}" == f"{request.url.scheme}://{request.headers.get('host', '')}"

    async def check_post(self, request: Request) -> Response | None:
        """None when this state-changing request may go on, else the refusal."""
        if not self.actions:
            return PlainTextResponse("read-only dashboard: start it with --actions to change anything", 403)
        if not self._same_origin(request):
            return PlainTextResponse("refused: a state-changing request must come from the dashboard's pages", 403)
        sent = (await form_data(request)).get("csrf", [""])[0]
        if not hmac.compare_digest(sent.encode(), self.csrf(request).encode()):
            return PlainTextResponse("refused: missing or stale CSRF token (reload the page)", 403)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + _HEADERS
            await send(message)

        request = Request(scope, receive)
        scope.setdefault("state", {})
        scope["state"]["guard"] = self
        given = request.query_params.get("token")
        if self.token is not None and given is not None:
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                await PlainTextResponse("wrong token", 401)(scope, receive, with_headers)
                return
            url = request.url.remove_query_params("token")
            response: Response = RedirectResponse(str(url), 303)
            response.set_cookie(COOKIE, self._cookie, httponly=True, samesite="strict", path="/")
            await response(scope, receive, with_headers)
            return
        if not self._authorized(request):
            text = (
                "refused: open the dashboard with ?token=... (or send Authorization: Bearer ...)"
                if self.token is not None
                else "refused: without a token the dashboard serves this machine only (loopback)"
            )
            await PlainTextResponse(text, 401 if self.token else 403)(scope, receive, with_headers)
            return
        if request.method not in ("GET", "HEAD", "POST"):
            await PlainTextResponse("method not allowed", 405)(scope, receive, with_headers)
            return
        if request.method == "POST" and not self.actions:
            await PlainTextResponse("read-only dashboard: start it with --actions to change anything", 403)(
                scope, receive, with_headers
            )
            return
        await self.app(scope, receive, with_headers)
