"""The local KRaft broker lives in the package (bench e2e uses it too)."""

from stage.brokers.kraft import JARS, KraftBroker, KraftCluster, free_port, jars_available  # noqa: F401
