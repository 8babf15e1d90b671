"""The vLLM connector's metrics: :class:`TransferStats` (vLLM's ``KVConnectorStats``, its periodic
"KV Transfer metrics" log line) and :class:`TransferPromMetrics` (Prometheus counters on vLLM's
``/metrics``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["TransferPromMetrics", "TransferStats"]


class TransferStats(KVConnectorStats):
    """What the workers' engines did since the last report, as vLLM gathers it from every worker
    (``get_kv_connector_stats``, then :meth:`aggregate`) for its log line and ``/metrics``.

    ``data`` (plain, serializable): ``transfers`` (rooms that succeeded), ``bytes`` (KV bytes
    WRITEn or landed, every TP rank's), ``seconds`` (each successful room's time from its opening
    to its end), ``failures`` (failed rooms by kind: ``timeout``, ``aborted``, ``unreachable``,
    ``digest``, ``failed``). Rooms are counted on TP rank 0 only; bytes on every rank."""

    data: dict[str, Any]
    """vLLM's field (its base class declares it), restated for the type checker, which does not read
    vLLM's source (docs/DECISIONS.md, "The type check does not follow vLLM")."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"transfers": 0, "bytes": 0, "seconds": [], "failures": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data, more = self.data, other.data
        data["transfers"] += more.get("transfers", 0)
        data["bytes"] += more.get("bytes", 0)
        data["seconds"] = [*data["seconds"], *more.get("seconds", ())]
        failures = dict(data["failures"])
        for kind, count in more.get("failures", {}).items():
            failures[kind] = failures.get(kind, 0) + count
        data["failures"] = failures
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        out: dict[str, int | float] = {
            "Transfers": self.data["transfers"],
            "MB": round(self.data["bytes"] / 1e6, 3),
            "Avg transfer ms": round(1e3 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
        }
        for kind, count in sorted(self.data["failures"].items()):
            out[f"Failed ({kind})"] = count
        return out

    def is_empty(self) -> bool:
        return not (self.data["transfers"] or self.data["bytes"] or self.data["failures"])


class TransferPromMetrics(KVConnectorPromMetrics):
    """:class:`TransferStats` as Prometheus counters on vLLM's ``/metrics``: ``vllm:te_kv_transfers``,
    ``vllm:te_kv_bytes``, ``vllm:te_kv_failures`` (label ``kind``), and the histogram
    ``vllm:te_kv_transfer_seconds``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls

        def per_engine(metric: Any) -> dict[int, Any]:
            return {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}

        self.transfers = per_engine(
            counter(
                name="vllm:te_kv_transfers",
                documentation="KV transfers that succeeded.",
                labelnames=labelnames,
            )
        )
        self.bytes = per_engine(
            counter(
                name="vllm:te_kv_bytes", documentation="KV bytes moved, all TP ranks.", labelnames=labelnames
            )
        )
        self.seconds = per_engine(
            histogram(
                name="vllm:te_kv_transfer_seconds", documentation="Time from a room's opening to its success.",
                labelnames=labelnames, buckets=[0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0],
            )
        )  # fmt: skip
        self.failures = counter(
            name="vllm:te_kv_failures", documentation="KV transfers that failed, by kind.",
            labelnames=[*labelnames, "kind"],
        )  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        self.transfers[engine_idx].inc(data.get("transfers", 0))
        self.bytes[engine_idx].inc(data.get("bytes", 0))
        for seconds in data.get("seconds", ()):
            self.seconds[engine_idx].observe(seconds)
        for kind, count in data.get("failures", {}).items():
            self.failures.labels(*self.per_engine_labelvalues[engine_idx], kind).inc(count)
