"""The streamable HTTP transport: bearer token through the SDK's auth (RFC 9728 metadata, WWW-Authenticate
with resource_metadata), DNS-rebinding protection always on with an allow-list of hosts and origins.

TLS is a reverse proxy's job (README: "Serving MCP beyond this machine"); SCRIPTORIUM_MCP_PUBLIC_URL
says the https:// address clients use, which the metadata and allow-lists then name.
"""

import hmac
import json
import re
import socket
import sys
from dataclasses import dataclass
from urllib.parse import urlparse

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.transport_security import TransportSecuritySettings

from orchestrator.settings import Settings

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


class StaticTokenVerifier:
    """The SDK's TokenVerifier for one shared secret, compared in constant time."""

    def __init__(self, token: str, resource: str):
        self._expected = token.encode()
        self.resource = resource

    async def verify_token(self, token: str) -> AccessToken | None:
        if not hmac.compare_digest(token.strip().encode(), self._expected):
            return None
        return AccessToken(token="<redacted>", client_id="scriptorium-token", scopes=[], resource=self.resource)


@dataclass(frozen=True)
class Exposure:
    """How the server is reached: the public MCP URL and the names clients may use for it."""

    url: str  # the MCP endpoint as clients see it
    names: tuple[str, ...]  # host names and addresses (beyond localhost) the Host header may carry

    @classmethod
    def of(cls, settings: Settings, host: str, port: int) -> "Exposure":
        names: list[str] = []
        if host not in WILDCARDS and host not in LOCAL_HOSTS:
            names.append(host)
        if host in WILDCARDS:  # every interface: this machine's own names
            names += [socket.gethostname(), socket.getfqdn()]
        if settings.mcp_public_url:
            names.append(urlparse(settings.mcp_public_url).hostname or "")
        public = settings.mcp_public_url or f"http://{_netloc(host, port)}/mcp"
        return cls(public, tuple(dict.fromkeys(n for n in names if n and n not in LOCAL_HOSTS)))


def _netloc(host: str, port: int) -> str:
    if host in WILDCARDS:
        host = socket.getfqdn() or "localhost"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def transport_security(settings: Settings, exposure: Exposure) -> TransportSecuritySettings:
    hosts = ["127.0.0.1:*", "localhost:*", "[::1]:*", "127.0.0.1", "localhost", "[::1]"]
    origins = ["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*", "http://127.0.0.1", "http://localhost"]
    for name in exposure.names:
        shown = f"[{name}]" if ":" in name else name
        hosts += [shown, f"{shown}:*"]
        origins += [f"{scheme}://{shown}{port}" for scheme in ("http", "https") for port in ("", ":*")]
    for host in settings.mcp_allowed_hosts:  # a name without a port: on any port
        hosts += [host] if _has_port(host) else [host, f"{host}:*"]
    for origin in settings.mcp_allowed_origins:
        origins += [origin] if _has_port(urlparse(origin).netloc) else [origin, f"{origin}:*"]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts,
                                     allowed_origins=origins)


def _has_port(netloc: str) -> bool:
    return bool(re.search(r":(\d+|\*)$", netloc)) and not netloc.endswith("]")


def auth_for(settings: Settings, exposure: Exposure) -> tuple[AuthSettings, StaticTokenVerifier] | None:
    """The SDK's auth for a static token: it serves /.well-known/oauth-protected-resource/mcp (RFC 9728) and
    answers 401 with WWW-Authenticate: Bearer ..., resource_metadata="...". There is no OAuth flow: the
    metadata names this server's origin as the authorization server, and the token is SCRIPTORIUM_MCP_TOKEN."""
    if not settings.mcp_token:
        return None
    parsed = urlparse(exposure.url)
    auth = AuthSettings(issuer_url=f"{parsed.scheme}://{parsed.netloc}", resource_server_url=exposure.url,
                        validate_token_resource=False)
    return auth, StaticTokenVerifier(settings.mcp_token, exposure.url)


class Explain:
    """ASGI middleware: the SDK's refusals (401 token, 421 Host, 403 Origin) get a message naming the setting."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope["headers"]}
        held: dict = {}

        async def explaining(message):
            if message["type"] == "http.response.start" and message["status"] in (401, 403, 421):
                held["start"] = message
                return
            if message["type"] == "http.response.body" and "start" in held:
                start = held.pop("start")
                body = _explained(start["status"], message.get("body", b""), headers)
                keep = [(k, v) for k, v in start["headers"] if k.lower() not in (b"content-length", b"content-type")]
                start = {**start, "headers": keep + [(b"content-type", b"application/json"),
                                                     (b"content-length", str(len(body)).encode())]}
                await send(start)
                return await send({"type": "http.response.body", "body": body})
            await send(message)

        await self.app(scope, receive, explaining)


def _explained(status: int, body: bytes, headers: dict) -> bytes:
    try:
        data = json.loads(body) if body.strip().startswith(b"{") else {"error": body.decode(errors="replace")}
    except ValueError:
        data = {"error": body.decode(errors="replace")}
    if status == 401:
        data["message"] = "send Authorization: Bearer <token>, the token the server has in SCRIPTORIUM_MCP_TOKEN"
    elif status == 421:
        data["message"] = (f"this server does not answer to Host {headers.get('host')!r}; add it to "
                           "SCRIPTORIUM_MCP_ALLOWED_HOSTS (host or host:port, comma-separated) or set "
                           "SCRIPTORIUM_MCP_PUBLIC_URL to the address clients use")
    elif "origin" in str(data.get("error", "")).lower():
        data["message"] = (f"requests from Origin {headers.get('origin')!r} are refused (DNS-rebinding "
                           "protection); add it to SCRIPTORIUM_MCP_ALLOWED_ORIGINS (comma-separated) if you trust it")
    return json.dumps(data).encode()


def serve_http(settings: Settings, host: str, port: int, budget: float | None) -> int:
    import uvicorn

    from mcp_server.server import build_server

    if host not in LOCAL_HOSTS and not settings.mcp_token:
        print(f"error: refusing to serve MCP on {host} without a token; set SCRIPTORIUM_MCP_TOKEN (clients then send "
              "Authorization: Bearer <token>) or bind to 127.0.0.1", file=sys.stderr)
        return 2
    exposure = Exposure.of(settings, host, port)
    server = build_server(settings, budget=budget, transport="http", auth=auth_for(settings, exposure))
    app = server.streamable_http_app(streamable_http_path="/mcp",
                                     transport_security=transport_security(settings, exposure), host=host)
    uvicorn.run(Explain(app), host=host, port=port, log_level="warning")
    return 0
