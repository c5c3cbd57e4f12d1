"""Who may reach the dashboard, and what a request must be before it acts.

optuna-dashboard has no authentication, and its API can delete a study, so `Guard` stands in front of the whole app,
optuna-dashboard's routes included:

- Bound to a loopback address, the server answers only requests addressed to a loopback name (no DNS rebinding).
- A write (any method but GET, HEAD, OPTIONS) from another origin is refused (403).
- With a token (`resolve_token`: always one on a non-loopback bind), every request carries it: ``Authorization: Bearer
  <token>``, or a cookie set by opening ``/rfopt?token=<token>`` once. No token: 401; a wrong one: 403.

An action's body is JSON only (`json_body`): a cross-site HTML form cannot send that without a CORS preflight this
server never grants. `actor` names who asked, for the op's record.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import urllib.parse
from collections.abc import Callable, Iterable
from http.cookies import SimpleCookie
from typing import Any

from bottle import HTTPResponse, request

TOKEN_ENV = "RFOPT_DASHBOARD_TOKEN"


class Guard:
    """WSGI middleware in front of the whole app: the token, the Host check, no cross-origin writes."""

    def __init__(self, app: Callable, *, token: str | None, loopback: bool) -> None:
        self.app = app
        self.token = token
        self.loopback = loopback

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        host = environ.get("HTTP_HOST", "")
        if self.loopback and host and not is_loopback(_hostname(host)):
            return _refuse(start_response, 403, f"this dashboard answers only requests to localhost, not to {host!r}")
        origin = environ.get("HTTP_ORIGIN")
        if method not in ("GET", "HEAD", "OPTIONS") and origin and urllib.parse.urlsplit(origin).netloc != host:
            return _refuse(start_response, 403, f"cross-origin request from {origin} refused")
        if self.token is None:
            return self.app(environ, start_response)
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        cookie_name = f"rfopt_token_{environ.get('SERVER_PORT', '')}"
        if method == "GET" and "token" in query:
            return self._keep_token(environ, start_response, query, cookie_name)
        given = _bearer(environ.get("HTTP_AUTHORIZATION", ""))
        if given is None:
            morsel = SimpleCookie(environ.get("HTTP_COOKIE", "")).get(cookie_name)
            given = morsel.value if morsel is not None else None
        if given is None:
            return _refuse(start_response, 401, "a token is required: send 'Authorization: Bearer <token>', "
                           "or open /rfopt?token=<token> (printed by rfopt dashboard at startup)")
        if not self._matches(given):
            return _refuse(start_response, 403, "wrong token")
        return self.app(environ, start_response)

    def _keep_token(self, environ: dict[str, Any], start_response: Callable, query: dict[str, list[str]],
                    cookie_name: str) -> list[bytes]:
        """``?token=``: keep the token in a cookie and drop it from the address bar (and from history and
        referrers)."""
        if not self._matches(query["token"][0]):
            return _refuse(start_response, 403, "wrong token")
        rest = urllib.parse.urlencode([(k, v) for k, vs in query.items() if k != "token" for v in vs])
        location = environ.get("PATH_INFO", "/") + (f"?{rest}" if rest else "")
        start_response("303 See Other", [
            ("Location", location),
            ("Set-Cookie", f"{cookie_name}={self.token}; Path=/; HttpOnly; SameSite=Lax"),
            ("Content-Length", "0"),
        ])
        return [b""]

    def _matches(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.token.encode())


def _refuse(start_response: Callable, status: int, message: str) -> list[bytes]:
    reason = {401: "Unauthorized", 403: "Forbidden"}[status]
    body = json.dumps({"error": message}).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if status == 401:
        headers.append(("WWW-Authenticate", 'Bearer realm="rfopt"'))
    start_response(f"{status} {reason}", headers)
    return [body]


def _bearer(header: str) -> str | None:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _hostname(host_header: str) -> str:
    return urllib.parse.urlsplit(f"//{host_header}").hostname or ""


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP address (``127.0.0.1``, ``::1``, ``[::1]``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_token(host: str, token: str | None = None) -> tuple[str | None, bool]:
    """The token the server will require, and whether it was generated: a non-loopback bind always has one.

        >>> resolve_token("127.0.0.1", "s3cret")
        ('s3cret', False)
    """
    token = token or os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        return secrets.token_urlsafe(24), True
    return token, False


# ---------------------------------------------------------------------- an action's request
def json_error(status: int, message: str) -> HTTPResponse:
    """The answer to a refused request: ``{"error": message}`` with `status`."""
    return HTTPResponse(json.dumps({"error": message}), status=status, headers={"Content-Type": "application/json"})


def json_body() -> dict[str, Any]:
    """The current request's body, a JSON object (empty: ``{}``); else raises the 415 or 400 answer."""
    # JSON only: a cross-site HTML form cannot send it without a CORS preflight this server never grants.
    if request.content_length and not request.content_type.startswith("application/json"):
        raise json_error(415, "send the request body as JSON (Content-Type: application/json)")
    raw = request.body.read() or b"{}"
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise json_error(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise json_error(400, "the request body must be a JSON object")
    return body


def actor() -> str:
    """Who asked, as an op records it: ``dashboard (127.0.0.1)``."""
    return f"dashboard ({request.remote_addr or 'unknown'})"
