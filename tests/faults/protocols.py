"""The two consumer group protocols the fault suites run the stage under.

KIP-848 (``group_protocol: consumer``) takes the session timeout and heartbeat interval from the
brokers (45 s at least by default): the suites' brokers carry them as short as the classic
cases' client settings (``session.timeout.ms`` 6000, ``heartbeat.interval.ms`` 500 in
tests/integration/harness.py). They change nothing for classic members.
"""

KIP848_BROKER = {"group.consumer.min.session.timeout.ms": "3000", "group.consumer.session.timeout.ms": "6000",
                 "group.consumer.min.heartbeat.interval.ms": "500",
                 "group.consumer.heartbeat.interval.ms": "500"}

# stage settings per protocol (over tests.integration.harness.stage_config's)
PROTOCOLS = {"classic": {}, "kip848": {"group_protocol": "consumer", "consumer": {}}}
