"""keyq janitor (see docs/architecture.md)."""
