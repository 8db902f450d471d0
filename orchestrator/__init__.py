"""Clients, pipelines and the job store."""
