"""SDK clients with a name of their own (their clientInfo), for the shared-run tests."""

from mcp import Client
from mcp.types import Implementation

from tests.mcp_server.http_server import MCPHTTPServer


def agent(server: MCPHTTPServer, name: str) -> Client:
    return Client(f"{server.url}/mcp", client_info=Implementation(name=name, version="1.0"))
