"""docker-compose.yml is checked by reading it, since no Docker engine runs the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_services_and_ports_match_the_default_settings() -> None:
    services = _compose()["services"]
    assert {"rabbitmq", "redis"} <= set(services)
    rabbit, redis = services["rabbitmq"], services["redis"]
    assert str(rabbit["image"]).startswith("rabbitmq:4") and "management" in rabbit["image"]
    assert str(redis["image"]).startswith("redis:7")
    assert "5672:5672" in rabbit["ports"] and "15672:15672" in rabbit["ports"]
    assert "6379:6379" in redis["ports"]
    for service in (rabbit, redis):
        assert service["healthcheck"]["test"][0] == "CMD"
