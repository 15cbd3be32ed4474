"""The Kafka runtime: the consumer loop (decode -> buffer -> finalize -> publish + commit),
rebalances, back-pressure and shutdown. Import StageRuntime from stage.runtime.loop.

``state/`` what is held about the assigned partitions; ``steps/`` one class per step of an
iteration; ``kafka/`` the clients, broker queries, ledger, topics and schema registry;
``task/`` what runs on a finalize worker; here: the loop, exit codes, stats and gauges, the
allocator tuning and the publisher's thread."""
