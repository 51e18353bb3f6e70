"""Prometheus's text exposition format (version 0.0.4), parsed: what ``rabbitmq_prometheus``
answers on ``/metrics``, ``/metrics/per-object`` and ``/metrics/detailed``.

Pure functions, no I/O. A line that is not in the format is skipped and counted, never taken
for a sample: RabbitMQ 3.10 writes label values without escaping them, so a queue named
``a"b`` makes a line no parser can read, and the other queues' lines must still count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from keyq.broker.errors import PrometheusFormatError

_SAMPLE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:[ \t]*\{(?P<labels>.*)\})?"
    r"[ \t]+(?P<value>\S+)(?:[ \t]+(?P<timestamp>-?[0-9]+))?"
)
_LABEL = re.compile(
    r"[ \t]*(?P<name>[a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"
    r'"(?P<value>(?:[^"\\\n]|\\.)*)"[ \t]*(?P<end>,|$)'
)
_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?Inf|NaN")


@dataclass(frozen=True)
class Sample:
    """One line's metric: its name, its labels and its value."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Exposition:
    """What one scrape said: its samples in order, and the numbers (from 1) of the lines that
    could not be parsed."""

    samples: list[Sample] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def named(self, name: str) -> list[Sample]:
        return [sample for sample in self.samples if sample.name == name]


def parse_exposition(text: str, only: Collection[str] | None = None) -> Exposition:
    """The samples of ``text`` (of the metrics in ``only``, if given: a scrape of 100,000
    queues has half a million lines, and a caller usually wants two metrics of them)."""
    found = Exposition()
    for number, line in enumerate(text.splitlines(), start=1):
        if only is not None and _metric_name(line) not in only:
            continue
        try:
            sample = parse_line(line)
        except PrometheusFormatError:
            found.skipped.append(number)
            continue
        if sample is not None:
            found.samples.append(sample)
    return found


def parse_line(line: str) -> Sample | None:
    """The sample on ``line``; None for a comment or a blank line. Raises
    ``PrometheusFormatError`` for anything else that is not a sample."""
    stripped = line.strip(" \t\r")
    if not stripped or stripped.startswith("#"):
        return None
    matched = _SAMPLE.fullmatch(stripped)
    if matched is None:
        raise PrometheusFormatError(f"not a sample: {_shown(line)}")
    labels = _labels(matched["labels"] or "", line)
    return Sample(matched["name"], labels, _value(matched["value"], line))


def _labels(text: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    while position < len(text.rstrip(" \t")):
        matched = _LABEL.match(text, position)
        if matched is None:
            raise PrometheusFormatError(f"labels cannot be read: {_shown(line)}")
        name = matched["name"]
        if name in labels:
            raise PrometheusFormatError(f"label {name!r} given twice: {_shown(line)}")
        labels[name] = _unescape(matched["value"], line)
        position = matched.end()
    return labels


def _unescape(value: str, line: str) -> str:
    def one(matched: re.Match[str]) -> str:
        escaped = _ESCAPES.get(matched[1])
        if escaped is None:
            raise PrometheusFormatError(f"unknown escape \\{matched[1]}: {_shown(line)}")
        return escaped

    return _ESCAPE.sub(one, value) if "\\" in value else value


def _value(text: str, line: str) -> float:
    if not _NUMBER.fullmatch(text):
        raise PrometheusFormatError(f"not a value: {_shown(line)}")
    return math.nan if text == "NaN" else float(text)


def _metric_name(line: str) -> str:
    """The metric name a line starts with (cheaply, to skip lines nobody asked for)."""
    end = len(line)
    for stop in ("{", " ", "\t"):
        found = line.find(stop, 0, end)
        if found != -1:
            end = found
    return line[:end]


def _shown(line: str, limit: int = 120) -> str:
    return repr(line if len(line) <= limit else line[:limit] + "...")
