"""The embedded stack: nats-server and PostgreSQL run from their wheels."""
