"""The network faults, each as Toxiproxy toxics on one replica's proxies (``ProxiedCluster``).
A fault is a function (toxiproxy, cluster, replica, node ids) that sets it; healing is
``toxiproxy.reset()`` (every toxic removed, every proxy enabled)."""

from __future__ import annotations

BOTH = ("upstream", "downstream")


def _each(toxiproxy, cluster, client, nodes, kind, streams=BOTH, toxicity=1.0, **attributes):
    for node in nodes:
        for stream in streams:
            toxiproxy.toxic(cluster.proxy_name(client, node), kind, stream, toxicity, **attributes)


def hold(toxiproxy, cluster, client, nodes) -> None:
    """A silent partition: connections stay open (and new ones are accepted) but no byte moves
    either way (``timeout`` with timeout 0). The heal closes the connections it held and drops
    what they held (Toxiproxy closes a timeout toxic's connections when it is removed), as a
    partition long enough for TCP to give up does."""
    _each(toxiproxy, cluster, client, nodes, "timeout", timeout=0)


def delay(toxiproxy, cluster, client, nodes) -> None:
    """A silent partition whose held requests (a Produce, an EndTxn) are all delivered at the
    heal, late: a latency far longer than any fault (Toxiproxy passes a latency toxic's data on
    when it is removed)."""
    _each(toxiproxy, cluster, client, nodes, "latency", latency=3_600_000, jitter=0)


def refuse(toxiproxy, cluster, client, nodes) -> None:
    """A loud partition: every connection is closed and new ones are refused (proxy disabled)."""
    for node in nodes:
        toxiproxy.enable(cluster.proxy_name(client, node), False)


def latency(ms: int, jitter: int):
    def apply(toxiproxy, cluster, client, nodes) -> None:
        _each(toxiproxy, cluster, client, nodes, "latency", latency=ms, jitter=jitter)
    apply.__name__ = f"latency {ms}±{jitter} ms"
    return apply


def reset_peer(after_ms: int, toxicity: float):
    """Connections reset (TCP RST) ``after_ms`` after data, on a share ``toxicity`` of them."""
    def apply(toxiproxy, cluster, client, nodes) -> None:
        _each(toxiproxy, cluster, client, nodes, "reset_peer", ("downstream",), toxicity, timeout=after_ms)
    apply.__name__ = f"reset_peer after {after_ms} ms on {toxicity:.0%}"
    return apply


def slow_close(delay_ms: int):
    def apply(toxiproxy, cluster, client, nodes) -> None:
        _each(toxiproxy, cluster, client, nodes, "slow_close", delay=delay_ms)
    apply.__name__ = f"slow_close {delay_ms} ms"
    return apply


def slicer(average: int, variation: int, delay_us: int):
    """TCP data cut into small packets (``average``±``variation`` bytes) ``delay_us`` apart."""
    def apply(toxiproxy, cluster, client, nodes) -> None:
        _each(toxiproxy, cluster, client, nodes, "slicer", average_size=average,
              size_variation=variation, delay=delay_us)
    apply.__name__ = f"slicer {average}±{variation} B / {delay_us} us"
    return apply


def bandwidth(kb_per_s: int):
    def apply(toxiproxy, cluster, client, nodes) -> None:
        _each(toxiproxy, cluster, client, nodes, "bandwidth", rate=kb_per_s)
    apply.__name__ = f"bandwidth {kb_per_s} KB/s"
    return apply


hold.__name__, delay.__name__ = "hold (silent partition, dropped at the heal)", "delay (silent partition, delivered at the heal)"
refuse.__name__ = "refuse (connections cut)"
