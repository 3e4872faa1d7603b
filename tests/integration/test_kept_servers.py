"""A server another process started and keeps (the sets tests/live/fleet.py keeps running),
adopted by this one (testbed/live_servers.py `adopt_server`): it is seen alive, signalled,
seen gone and restarted here, and the keeper, handed the restarted pid back, stops it and
finds nothing left. The server is a plain sleeping process: what is under test is the
process bookkeeping, which a `vllm serve` would only make slower."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from testbed.live_servers import adopt_server, poll_until, proc_info, server_record
from testbed.shipped_model import ROOT

KEEPER = """
import json, os, signal, sys, threading
from pathlib import Path
from testbed.live_servers import Adopted, LiveRun, Server, server_record
from testbed.ports import free_port

record_path = Path(sys.argv[1])
run = LiveRun("keeper")
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
server = Server("sleeper", sleeper, dict(os.environ), run.dir, free_port()).start()
run.servers.append(server)  # as LiveRun.vllm and .proxy do
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
record_path.write_text(json.dumps({"dir": str(run.dir), **server_record(server)}))
while not stop.wait(0.2):
    server.proc.poll()  # reaps what the adopter killed
record = json.loads(record_path.read_text())
if record["pid"] != server.pid:
    server.proc, server.starts = Adopted(record["pid"]), record["starts"]
    server.pids()
report = run.close()
print("keeper:", "clean" if report.clean else report.problems(), flush=True)
"""


def test_an_adopted_server_is_signalled_restarted_and_handed_back(tmp_path: Path) -> None:
    record_path = tmp_path / "record.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    keeper = subprocess.Popen(
        [sys.executable, "-c", KEEPER, str(record_path)], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    restarted = None
    try:
        written, _ = poll_until(record_path.exists, 60, 0.1)
        assert written, "the keeper wrote no record"
        time.sleep(0.5)  # the record written whole
        record = json.loads(record_path.read_text())
        server = adopt_server(record, Path(record["dir"]))
        first = server.pid
        assert server.alive() and server.pids() == [first]
        server.kill()
        assert server.wait_gone(10), "the SIGKILLed adopted server was still seen alive"
        assert not server.alive()
        server.start()  # as Cluster.ensure restarts an engine a case killed
        restarted = server.pid
        assert restarted != first and server.alive() and server.starts == record["starts"] + 1
        record_path.write_text(json.dumps({"dir": record["dir"], **server_record(server)}))
    finally:
        keeper.send_signal(signal.SIGTERM)
        out = keeper.communicate(timeout=60)[0]
    if restarted is not None:  # stopped by the keeper, reaped here (our child)
        survived = None if server.wait_gone(10) else proc_info(restarted)
        server.stop()  # (this test's own leftover, if the keeper left it)
        assert survived is None, f"the keeper left the restarted server: {survived}"
    assert "keeper: clean" in out, out
