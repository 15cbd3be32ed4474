"""Why the stage stopped: one exit code per failure an operator must act on, with a message
that says what happened and what to do (docs/operations.md, "Exit codes and start-up checks")."""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1          # a bug: the traceback is in the log
EXIT_USAGE = 2               # bad command-line arguments (argparse)
EXIT_CONFIG = 3              # invalid configuration (file or environment)
EXIT_KAFKA_UNREACHABLE = 4   # no broker answered at start
EXIT_TOPOLOGY = 5            # topics missing, not co-partitioned, or repartitioned while running
EXIT_FENCED = 6              # another process uses this replica's transactional.id
EXIT_DEVICE = 7              # the finalize device cannot be used
EXIT_KAFKA_FATAL = 8         # any other fatal Kafka client error
EXIT_SCHEMA_REGISTRY = 9     # the stage's own output schemas could not be registered


class StageExit(RuntimeError):
    """Stop the stage with ``code``; ``str()`` is the paragraph printed for the operator."""

    def __init__(self, code: int, message: str, *, abandon_threads: bool = False) -> None:
        super().__init__(message)
        self.code = code
        # A thread is stuck inside the Kafka client: shut down without waiting for it, and
        # end the process without joining it (the CLI uses os._exit).
        self.abandon_threads = abandon_threads


def fenced(transactional_id: str, detail: str) -> StageExit:
    return StageExit(EXIT_FENCED, (
        f"this replica was fenced: another process started with the same transactional.id "
        f"{transactional_id!r} ({detail}). Kafka lets only the newest producer with an id "
        "commit, so this one stopped without publishing anything further. Give every replica "
        "its own stable transactional_id (the Helm chart uses the pod name; with compose, one "
        "service per replica with its own ROLLOUT_REASSEMBLER_TRANSACTIONAL_ID) and make sure no "
        "second copy of this replica is running."))


def kafka_fatal(detail: str) -> StageExit:
    return StageExit(EXIT_KAFKA_FATAL, (
        f"fatal Kafka client error: {detail}. The stage stopped; nothing past the last "
        "committed transaction was published or committed, so a restart resumes from there. "
        "If it repeats, check the brokers' logs and the client settings named in the error."))


def publish_stalled(seconds: float, transactional_id: str) -> StageExit:
    return StageExit(EXIT_KAFKA_FATAL, (
        f"a Kafka transaction has not completed in {seconds:.0f}s, past the transaction timeout, "
        "so the brokers have aborted it already, and no new producer could be started in that "
        "time to fence it (the brokers did not answer). This is how librdkafka's transactional "
        "calls hang after a coordinator's broker restarted (librdkafka issues #5511 and #5456); "
        "normally the stage replaces the stuck producer after publish_stuck_ms and goes on. It "
        "stopped without waiting for the stuck call; nothing past the last committed transaction "
        "was published or committed, and the restarted process (the same transactional.id "
        f"{transactional_id!r} fences this one) resumes from there. Restart it (Kubernetes and "
        "compose do) and check that the brokers are reachable."),
        abandon_threads=True)
