"""The SDK examples pointed at an address where no broker answers (issue 27 item 3): before,
`producer_fleet.py` printed hundreds of librdkafka FAIL lines and after 71 s a DeliveryError
traceback, `trainer_loop.py` hundreds of lines and a KafkaException traceback; neither named
the address. Now each exits 1 with one line naming the address and its option, librdkafka's
own lines rate limited. No broker is needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stage.brokers.kraft import free_port
from tests.examples.test_examples import EXAMPLES, ROOT, base_env


@pytest.mark.parametrize("program,args", [("producer_fleet.py", ["--groups", "2"]),
                                          ("trainer_loop.py", ["--idle-timeout", "5"])])
def test_a_wrong_bootstrap_is_one_line_naming_the_address(program, args, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, str(EXAMPLES / program), "--bootstrap-servers", address,
                           "--checkpoint" if program == "trainer_loop.py" else "--seed",
                           str(tmp_path / "ckpt") if program == "trainer_loop.py" else "1", *args],
                          cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    (line,) = [x for x in lines if "no Kafka broker answered" in x]
    assert line.startswith(f"{program}: ") and f"at {address} within 15s" in line
    assert "--bootstrap-servers" in line and "KAFKA_BOOTSTRAP_SERVERS" in line
    print(f"\n{program}: {len(lines)} stderr line(s):\n" + "\n".join(x[:160] for x in lines))
    assert len(lines) <= 10, lines         # librdkafka's own: at most 3 of a kind a minute
