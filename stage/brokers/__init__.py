"""Brokers the project starts itself: a real Apache Kafka (KRaft) from the Maven Central jars
for development and tests (stage.brokers.kraft), and the embedded Tansu broker the demo uses
when no broker is configured (stage.brokers.embedded). The stage itself never starts one."""
