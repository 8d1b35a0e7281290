"""What the data plane's request path uses of prometheus_client beyond its public API, fenced in
one module.

A counter's or gauge's `inc` and a histogram's `observe` check on every call that the metric is
a child with its label values, then update the child's values, each a float under a lock (or, with
`serve --workers N`, in the worker's file). The request path updates children it resolved once
(`dataplane.metrics`), so it updates those values directly: the same values, read the same way
by the registry and the multiprocess collector, hence the same exposition. What that relies on
is checked when this module is imported (`check_private_surface`): a prometheus_client whose
metrics keep their values otherwise stops the import with `PrometheusClientChanged`, naming its
version, instead of counting wrong. `tests/test_private_surface.py` runs the check;
pyproject.toml pins the prometheus_client it was tested on.
"""

from __future__ import annotations

import inspect
from bisect import bisect_left
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram, values

from dataplane.private_surface import require_surface


class PrometheusClientChanged(RuntimeError):
    """The installed prometheus_client keeps a metric's values otherwise than the data plane
    updates them."""


class Value(Protocol):
    """A child counter's or gauge's value (prometheus_client's `values.ValueClass`): `inc(amount)`
    adds `amount`, which for a counter must not be negative."""

    def inc(self, amount: float) -> None: ...


def value_of(child: Counter | Gauge) -> Value:
    """The value that a labelled counter's or gauge's child (`metric.labels(...)`), or a metric
    without labels, updates in `inc` and `dec`."""
    return child._value


class Observer:
    """A histogram's `observe`, on the child's sum and buckets directly."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._sum = child._sum
        self._buckets = child._buckets
        self._bounds = list(child._upper_bounds)

    def observe(self, amount: float) -> None:
        self._sum.inc(amount)
        # The first bucket whose upper bound is at least `amount` (the last one's is +Inf).
        self._buckets[bisect_left(self._bounds, amount)].inc(1)


def _names(function) -> set[str]:
    return set(inspect.unwrap(function).__code__.co_names)


def check_private_surface() -> None:
    """Raise PrometheusClientChanged unless prometheus_client's metrics still keep their values
    as `value_of` and `Observer` update them (read from its code: a metric made here would be
    written to a worker's multiprocess files)."""
    inc = getattr(values.ValueClass, "inc", None)
    expected = [
        (
            inc is not None and list(inspect.signature(inc).parameters) == ["self", "amount"],
            "values.ValueClass.inc(self, amount)",
        ),
        (
            all({"_value", "ValueClass"} <= _names(metric._metric_init) for metric in (Counter, Gauge)),
            "Counter._metric_init and Gauge._metric_init keeping the value in _value, a values.ValueClass",
        ),
        (
            {"_value", "inc"} <= _names(Counter.inc) and {"_value", "inc"} <= _names(Gauge.inc),
            "Counter.inc and Gauge.inc adding to _value",
        ),
        (
            {"_sum", "_buckets", "_upper_bounds", "ValueClass"} <= _names(Histogram._metric_init),
            "Histogram._metric_init keeping _sum and one values.ValueClass in _buckets per bound of _upper_bounds",
        ),
        (
            {"_sum", "_buckets", "_upper_bounds", "inc"} <= _names(Histogram.observe),
            "Histogram.observe adding to _sum and to the first bucket of _buckets whose bound holds the amount",
        ),
    ]
    require_surface("prometheus_client", expected, PrometheusClientChanged)


check_private_surface()
