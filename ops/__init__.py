"""Stack lifecycle: plan, up/down, health, systemd, backup."""
