"""The streamable HTTP transport: a bearer token (mcp_server/bearer.py), DNS-rebinding protection always on with
an allow-list of hosts and origins.

TLS is a reverse proxy's job (README: "Serving MCP beyond this machine"); SCRIPTORIUM_MCP_PUBLIC_URL
says the https:// address clients use, which the metadata and allow-lists then name.
"""

import json
import re
import socket
import sys
from dataclasses import dataclass
from urllib.parse import urlparse

from mcp.server.transport_security import TransportSecuritySettings

from common.settings import Settings
from mcp_server.bearer import BearerToken

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Exposure:
    """How the server is reached: the names clients may use for it."""

    names: tuple[str, ...]  # host names and addresses (beyond localhost) the Host header may carry

    @classmethod
    def of(cls, settings: Settings, host: str) -> "Exposure":
        names: list[str] = []
        if host not in WILDCARDS and host not in LOCAL_HOSTS:
            names.append(host)
        if host in WILDCARDS:  # every interface: this machine's own names
            names += [socket.gethostname(), socket.getfqdn()]
        if settings.mcp_public_url:
            names.append(urlparse(settings.mcp_public_url).hostname or "")
        return cls(tuple(dict.fromkeys(n for n in names if n and n not in LOCAL_HOSTS)))


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


class Explain:
    """ASGI middleware: the SDK's refusals (421 Host, 403 Origin) get a message naming the setting."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope["headers"]}
        held: dict = {}

        async def explaining(message):
            if message["type"] == "http.response.start" and message["status"] in (403, 421):
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
    if status == 421:
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
    exposure = Exposure.of(settings, host)
    server = build_server(settings, budget=budget, transport="http")
    app = Explain(server.streamable_http_app(streamable_http_path="/mcp",
                                             transport_security=transport_security(settings, exposure), host=host))
    uvicorn.run(BearerToken(app, settings.mcp_token) if settings.mcp_token else app, host=host, port=port,
                log_level="warning")
    return 0
