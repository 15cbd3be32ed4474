"""The command line and the benchmark/parity scripts run and report coherent figures."""

import json
import subprocess
import sys
import time

import pytest

from stage.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stage", *args], capture_output=True, text=True,
                          timeout=300)


def test_bench_verify_json_report():
    proc = _run("bench", "verify", "--json", "--seconds", "0.2")
    report = json.loads(proc.stdout)
    large, small = report["results"]
    assert (large["case"], large["calls"], large["chain_calls"], large["tokens"]) == ("large", 71, 64, 33024)
    assert small["tokens"] < large["tokens"]
    for r in report["results"]:
        assert r["verify_tokens_per_s"] > 0 and r["hash_bound_tokens_per_s"] > 0
        # verification includes hashing the same bytes, so it can never beat the hash bound
        assert 0 < r["ratio_to_hash_bound"] < 1
        assert abs(r["verify_tokens_per_s"] / r["hash_bound_tokens_per_s"] - r["ratio_to_hash_bound"]) < 1e-9
    assert proc.returncode == (0 if report["meets_target"] else 1)


def test_bench_produce_waits_while_the_local_queue_is_full():
    from stage.bench.broker import produce

    class FullTwice:   # librdkafka raises BufferError while its queue is full
        def __init__(self):
            self.full, self.polls, self.sent = 2, 0, []

        def produce(self, topic, **kwargs):
            if self.full:
                self.full -= 1
                raise BufferError("Local: Queue full")
            self.sent.append((topic, kwargs))

        def poll(self, timeout):
            self.polls += 1

    producer = FullTwice()
    produce(producer, "t", key=b"k", value=b"v")
    assert producer.sent == [("t", {"key": b"k", "value": b"v"})] and producer.polls == 2


def test_bench_finalize_small_group_json():
    proc = _run("bench", "finalize", "--json", "--repeats", "1", "--rollouts", "2", "--calls", "3",
                "--tokens", "16", "--layers", "4", "--topk", "2", "--groups", "2", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["profile"] == "default" and "N=2 x 3 calls x 16 tokens" in report["profile_line"]
    assert report["torch_threads"] == 1 and "(1/5/15 min)" in report["load_before"]
    group = report["groups"][0]
    assert group["tokens"] == 2 * 3 * 16 and len(report["groups"]) == 2
    modes = group["modes"]
    assert set(modes) == {"direct", "deferred", "no-routes"}
    assert modes["no-routes"]["routes_ms"] == 0.0
    for r in modes.values():
        assert r["total_ms"] >= r["verify_ms"] > 0 and r["intake_ms"] > 0
    # deferred keeps no route payloads: the buffer holds less than in direct mode
    assert modes["deferred"]["buffered_bytes"] < modes["direct"]["buffered_bytes"]
    assert modes["direct"]["ratio_total_to_base64_sha256"] > 0
    scaling = report["scaling"]["results"]
    assert [(r["kind"], r["workers"]) for r in scaling] == [("thread", 1), ("thread", 2), ("process", 1), ("process", 2)]
    assert all(r["groups_per_s"] > 0 for r in scaling)


def test_bench_finalize_agentic_profile_prints_its_sizes():
    proc = _run("bench", "finalize", "--profile", "toy", "--repeats", "1", "--modes", "deferred")
    assert proc.returncode == 0, proc.stderr
    assert "profile toy: N=4" in proc.stdout and "deferred" in proc.stdout


def test_bench_profiles_are_the_workload_profiles():
    from stage.cli.bench import PROFILES
    from stage.bench.finalize import PROFILE_CHOICES
    from stage.workload import PROFILE_NAMES
    assert PROFILES == PROFILE_CHOICES == ("default", *PROFILE_NAMES)


def test_bench_wire_and_verify_print_the_profile():
    proc = _run("bench", "wire", "--json", "--profile", "agentic-moe")
    report = json.loads(proc.stdout)
    assert report["profile"] == "agentic-moe"
    assert {r["case"] for r in report["results"]} >= {"ReceiptEvent, 60-call manifest"}
    assert any("x48x8 int8 routes" in r["case"] for r in report["results"])
    proc = _run("bench", "verify", "--seconds", "0.2", "--profile", "toy")
    assert "profile toy: N=4" in proc.stdout


def test_cuda_parity_scripts_run_their_cpu_half():
    from stage.finalize import cuda_check as group_check
    from stage.routes import cuda_check as route_check
    assert group_check.check_devices("cpu", "cpu") > 0
    assert route_check.check_devices("cpu", "cpu") > 0
    assert group_check.main([]) == 0


def test_unknown_command_is_a_usage_error(capsys):
    try:
        main(["nonsense"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("argparse accepted an unknown command")


def _subparsers(parser):
    import argparse
    for action in parser._actions:   # argparse keeps subcommands in its _SubParsersAction
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                helps = {a.dest: a.help for a in action._choices_actions}
                yield name, helps.get(name), sub
                yield from _subparsers(sub)


def test_every_subcommand_and_option_has_help_with_its_default():
    from stage.cli import _parser
    seen = 0
    for name, help_text, sub in _subparsers(_parser()):
        assert help_text, f"subcommand {name} has no help"
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            seen += 1
            text = formatter._get_help_string(action) % {"default": action.default}
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            if action.nargs == 0 or action.required:   # flags are off by default; required has none
                continue
            assert "default" in text, f"{name} {action.option_strings[0]}: {text!r} does not state its default"
            if action.default is not None and action.default != []:
                assert str(action.default) in text, (name, action.option_strings, text)
        sub.format_help()   # renders
    assert seen > 40


@pytest.mark.parametrize("argv, message", [
    (["demo", "--partitions", "0"], "argument --partitions: must be >= 1, got 0"),
    (["demo", "--groups", "0"], "argument --groups: must be >= 1, got 0"),
    (["demo", "--group-size", "-1"], "argument --group-size: must be >= 1"),
    (["demo", "--fault-rate", "2"], "argument --fault-rate: must be in [0, 1]"),
    (["demo", "--device", "tpu"], "argument --device: must be cpu, cuda, cuda:N or auto"),
    (["demo", "--timeout", "0"], "argument --timeout: must be > 0"),
    (["demo", "--topic-prefix", "a b"], "argument --topic-prefix: must be letters"),
    (["demo", "--groups", "many"], "argument --groups: invalid integer >= 1 value: 'many'"),
    (["topics", "create", "--partitions", "0"], "argument --partitions: must be >= 1, got 0"),
    (["topics", "create", "--partitions", "2", "--replication", "1"],
     "--min-insync-replicas (2) must not exceed --replication (1)"),
    (["run", "--log-level", "chatty"], "argument --log-level: invalid choice: 'CHATTY'"),
    (["bench", "finalize", "--device", "tpu"], "argument --device: must be cpu, cuda, cuda:N or auto"),
])
def test_bad_arguments_are_refused_at_once(argv, message, capsys):
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert time.monotonic() - started < 5   # before any broker is started or contacted


CONFIGURED_COMMANDS = [["run"], ["topics", "check"], ["topics", "create", "--partitions", "1"],
                       ["inspect", "g"], ["dead-letters", "list"], ["dead-letters", "replay", "--all"],
                       ["broker", "--create-topics"]]


@pytest.mark.parametrize("argv", CONFIGURED_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_configuration_errors_exit_3_naming_the_setting_in_every_command(argv, tmp_path, monkeypatch, capsys):
    """Issue 27 item 7: `inspect` and `dead-letters` exited 2 (the usage code) on a configuration
    error, `run` and `topics` 3; one code everywhere (docs/configuration.md), before any broker
    is contacted or started."""
    monkeypatch.setenv("ROLLOUT_REASSEMBLER_POLL_TIMEOUT_MS", "-1")
    assert main(argv) == 3
    assert "configuration error: poll_timeout_ms = '-1' (environment ROLLOUT_REASSEMBLER_POLL_TIMEOUT_MS)" \
        in capsys.readouterr().err
    monkeypatch.delenv("ROLLOUT_REASSEMBLER_POLL_TIMEOUT_MS")
    assert main([*argv, "--config", str(tmp_path / "missing.yaml")]) == 3
    err = capsys.readouterr().err
    assert "configuration error" in err and "No such file" in err


def test_topics_create_defaults_are_production_safe():
    from stage.cli import _parser
    args = _parser().parse_args(["topics", "create", "--partitions", "12"])
    assert (args.replication, args.min_insync_replicas) == (3, 2)
