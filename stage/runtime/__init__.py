"""The Kafka runtime: configuration, the consumer loop (decode -> buffer -> finalize ->
publish + commit), rebalances, back-pressure and shutdown. Import StageRuntime from
stage.runtime.loop."""
