"""The one place a confluent-kafka SchemaRegistryClient is made (the SDK producer, the trainer's
reader, the deferred route fetcher, the stage and its operator commands), so that
authentication and TLS reach every one of them.

``schema_registry_config`` holds SchemaRegistryClient properties: ``basic.auth.user.info``
(``"<user>:<password>"``), ``ssl.ca.location``, ``ssl.certificate.location``,
``ssl.key.location``, and any other the client knows (``timeout``, ``max.retries``...); the
stage builds them from its ``schema_registry:`` settings (``SchemaRegistrySettings.client_properties``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def schema_registry_client(url: str, schema_registry_config: Mapping[str, Any] | None = None,
                           **overrides: Any):
    """A SchemaRegistryClient for ``url`` with ``schema_registry_config`` (then ``overrides``,
    written with ``_`` for ``.``: ``max_retries=0``)."""
    if not url:
        raise ValueError("framing 'confluent' needs schema_registry_url")
    from confluent_kafka.schema_registry import SchemaRegistryClient
    conf = {**(schema_registry_config or {}),
            **{key.replace("_", "."): value for key, value in overrides.items()}, "url": url}
    return SchemaRegistryClient(conf)
