"""The MCP tool surface for agents."""
