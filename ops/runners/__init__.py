"""How a service runs: as a plain process (the embedded default) or as a Docker container."""
