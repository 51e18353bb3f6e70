"""keyq worker (see docs/architecture.md)."""
