"""Keeps one of test_faults.py's shared server sets running, for its cases to run on.

Cases run against it again and again without starting it (docs/testing.md):

    python -m tests.live.fleet shm /tmp/shm-fleet.json     # prints LIVE_FLEET=..., waits
    LIVE_FLEET=/tmp/shm-fleet.json pytest tests/live/test_faults.py::TestShm::test_0_happy_path

Ctrl-C (or SIGTERM) stops the set and checks, as the class's own teardown does, that no
process and no /dev/shm object of it is left. Servers a case restarted are the keeper's
to stop: the case's session writes their pids back into the file."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import tests.conftest  # noqa: F401  (the suite's environment, which the servers inherit)
from testbed.live_servers import Adopted
from tests.live.test_faults import ROLES, SETS, cluster_record, start_set


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("transport", choices=sorted(SETS))
    p.add_argument("record", type=Path, help="the file that LIVE_FLEET names")
    a = p.parse_args(argv)
    cluster = start_set(a.transport)
    a.record.write_text(json.dumps(cluster_record(cluster)))
    print(f"LIVE_FLEET={a.record}  (Ctrl-C stops the set)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        for server in cluster.run.servers:  # reap what a case killed: no zombie stays
            if isinstance(server.proc, subprocess.Popen):
                server.proc.poll()
    record = json.loads(a.record.read_text())
    for role in ROLES:  # restarted by a case's session: adopted back, to be stopped
        server, kept = getattr(cluster, role), record[role]
        if kept["pid"] != server.pid:
            server.proc, server.starts = Adopted(kept["pid"]), kept["starts"]
            server.pids()
    report = cluster.run.close()
    print(report.summary(), flush=True)
    a.record.unlink(missing_ok=True)
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
