"""/metrics on prometheus_client: a registry per server, metrics that update several names at
once, values read at scrape time, and the page without `_created` samples.

prometheus_client writes the exposition format (escaping, `+Inf`, histogram buckets,
`_total` naming) the way every Prometheus client reads it, which a hand-written renderer had to
reimplement; it is thread-safe, so the engine thread can count its steps while the event loop
counts tokens. Each server has a `CollectorRegistry` of its own, never the process-wide default
one: two servers in one process (tests, benchmarks) each export only their own series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

#: The text exposition format 0.0.4 that `generate_latest` writes, what Prometheus, vLLM and the
#: benchmark clients scrape (prometheus_client's CONTENT_TYPE_LATEST names a newer version).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Naming:
    """One name a metric is exported under, with the labels every one of its series carries
    under that name (vLLM's `model_name` and `engine`) and its histogram bounds."""

    name: str
    const_labels: Mapping[str, str] = field(default_factory=dict)
    buckets: Sequence[float] = ()


class Series:
    """One quantity the server measures, exported under each of its names: `inc` and
    `observe` update every name's series. With no name (a naming set that leaves it out) it
    counts nothing."""

    def __init__(
        self,
        registry: CollectorRegistry,
        kind: Literal["counter", "histogram"],
        help_text: str,
        namings: Sequence[Naming],
        label_names: Sequence[str] = (),
        label_values: Iterable[Sequence[str]] = (),
    ) -> None:
        self.label_names = tuple(label_names)
        self._metrics: list[tuple[Any, dict[str, str]]] = []
        for naming in namings:
            names = (*naming.const_labels, *self.label_names)
            metric: Any
            if kind == "counter":
                metric = Counter(naming.name, help_text, names, registry=registry)
            else:
                metric = Histogram(
                    naming.name, help_text, names, registry=registry, buckets=naming.buckets
                )
            self._metrics.append((metric, dict(naming.const_labels)))
        self._children: dict[tuple[str, ...], list[Any]] = {}
        for values in label_values:  # declared up front: exported at 0 before the first event
            self._targets(tuple(values))
        # without labels of its own, the children once and for all: inc and observe run per
        # token on the event loop
        self._unlabeled = None if self.label_names else self._targets(())

    def _targets(self, values: tuple[str, ...]) -> list[Any]:
        children = self._children.get(values)
        if children is None:
            children = [
                metric.labels(*const.values(), *values) if const or values else metric
                for metric, const in self._metrics
            ]
            self._children[values] = children
        return children

    def _values(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"labels {sorted(labels)}; expected {list(self.label_names)}")
        return tuple(str(labels[name]) for name in self.label_names)

    def _children_for(self, labels: Mapping[str, str]) -> list[Any]:
        if self._unlabeled is not None and not labels:
            return self._unlabeled
        return self._targets(self._values(labels))

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        for child in self._children_for(labels):
            child.inc(amount)

    def observe(self, value: float, **labels: str) -> None:
        for child in self._children_for(labels):
            child.observe(value)

    # ---- reading back (tests, benchmarks): what the first name exports -------------------------

    def sample(self, suffix: str, **labels: str) -> float:
        """The value of the first name's sample `<name><suffix>` with these labels (0 when it
        has no such sample yet)."""
        if not self._metrics:
            return 0.0
        metric, const = self._metrics[0]
        wanted = {**const, **labels}
        for family in metric.collect():
            for sample in family.samples:
                if sample.name == family.name + suffix and sample.labels == wanted:
                    return float(sample.value)
        return 0.0

    def get(self, **labels: str) -> float:
        """A counter's value."""
        return self.sample("_total", **labels)

    @property
    def count(self) -> int:
        """A histogram's number of observations."""
        return int(self.sample("_count"))

    @property
    def sum(self) -> float:
        """A histogram's sum of observations."""
        return self.sample("_sum")


@dataclass(frozen=True)
class Scraped:
    """A value read at scrape time: `key` into what the read function returns."""

    key: str
    kind: Literal["counter", "gauge"]
    help_text: str
    namings: Sequence[Naming]


class ScrapeCollector:
    """Gauges and counters whose values another thread keeps (the engine thread's snapshot),
    read once per scrape: every name of a quantity shows the same value, taken at one moment."""

    def __init__(self, metrics: Sequence[Scraped], read: Callable[[], Mapping[str, float]]):
        self.metrics = list(metrics)
        self.read = read

    def _families(self, values: Mapping[str, float] | None) -> Iterable[Metric]:
        for metric in self.metrics:
            for naming in metric.namings:
                labels = list(naming.const_labels)
                family: CounterMetricFamily | GaugeMetricFamily
                if metric.kind == "counter":
                    family = CounterMetricFamily(naming.name, metric.help_text, labels=labels)
                else:
                    family = GaugeMetricFamily(naming.name, metric.help_text, labels=labels)
                if values is not None:
                    family.add_metric(list(naming.const_labels.values()), values[metric.key])
                yield family

    def collect(self) -> Iterable[Metric]:
        return self._families(self.read())

    def describe(self) -> Iterable[Metric]:
        """The names, without reading anything: the registry refuses a name registered twice."""
        return self._families(None)


class _WithoutCreated:
    """A registry's metrics minus their `_created` samples (the time each series was made).
    Nothing the server's users read needs them, and they would add a gauge per counter and
    histogram to every scrape. Filtered here rather than with
    `prometheus_client.disable_created_metrics()`, which would change every registry in the
    process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format (0.0.4) of everything in `registry`."""
    return generate_latest(_WithoutCreated(registry))
