"""Scraping a daemon's metrics endpoint and reading the families back with
``prometheus_client``'s own parser, for tests."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from keyq.broker.metrics import CONTENT_TYPE


@dataclass
class Family:
    help: str = ""
    kind: str = ""
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, name: str | None = None, **labels: str) -> float:
        """The one sample named ``name`` (the family's own by default) whose labels include
        ``labels``."""
        hits = [
            value
            for sample, have, value in self.samples
            if (name is None or sample == name) and labels.items() <= have.items()
        ]
        assert len(hits) == 1, f"{len(hits)} samples of {name} with {labels}"
        return hits[0]


def parse(text: str) -> dict[str, Family]:
    """The families of an exposition, by the name their samples carry: a counter under its
    ``_total`` name; ``_created`` samples left out."""
    families: dict[str, Family] = {}
    for parsed in text_string_to_metric_families(text):
        name = parsed.name + "_total" if parsed.type == "counter" else parsed.name
        assert name not in families, f"family {name} twice"
        family = families[name] = Family(help=parsed.documentation, kind=parsed.type)
        for sample in parsed.samples:
            if sample.name.endswith("_created"):
                continue
            if family.kind == "counter":
                assert sample.name == name, sample
            family.samples.append((sample.name, dict(sample.labels), float(sample.value)))
    return families


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    """(status, content type, body) of a GET on the local server."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


def scrape_families(port: int) -> dict[str, Family]:
    status, content_type, body = scrape(port)
    assert status == 200 and content_type == CONTENT_TYPE, (status, content_type)
    return parse(body)
