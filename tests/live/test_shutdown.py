"""A prefill stopped as operators stop it (SIGTERM) while it holds a ticket no decode will
read, under the default 120 s lease: vLLM ends a SIGTERM only once the engine has no work
left, and a prefill holding staging keeps stepping for a while after its last handoff (so
its gauge tells the truth). That while is bounded: the prefill exits in seconds, not at the
lease's end, and leaves nothing behind (no process, no staging segment)."""

from __future__ import annotations

import signal
import time

from testbed.live_servers import LiveRun, complete, copy_prompts, free_port, kv_config
from vllm_qaic_connector.scheduler_side import STEP_AFTER_STAGING_S

PAGES_IN_USE = "vllm:qaic_kv_staging_pages_in_use"
EXIT_GRACE_S = 8.0  # the API server's and the workers' own teardown


def test_a_sigterm_is_not_held_up_by_a_ticket_nobody_reads() -> None:
    run = LiveRun("shutdown")
    try:
        prefill = run.vllm("prefill", "0", kv_config("kv_producer", run.engine_id("p"),
                                                     free_port(), "shm"))  # fmt: skip
        prefill.wait_ready()
        (prompt, _), *_ = copy_prompts(1, f"shutdown-{prefill.port}")
        status, body = complete(prefill.url, prompt, 1, {"do_remote_decode": True})
        assert status == 200 and body["kv_transfer_params"]["do_remote_prefill"], body
        time.sleep(1.0)  # the prefill steps on, so its gauge shows the held ticket
        held = prefill.metric(PAGES_IN_USE)
        t0 = time.monotonic()
        prefill.kill(signal.SIGTERM)
        gone = prefill.wait_gone(STEP_AFTER_STAGING_S + EXIT_GRACE_S)
        took = time.monotonic() - t0
        print(f"[shutdown] pages_held={held:.0f} exited={gone} after_s={took:.1f}", flush=True)
        assert held >= 1, "the ticket's staging did not show in the gauge"
        assert gone, f"a SIGTERM'd prefill was still up after {took:.0f} s (lease 120 s)"
    finally:
        report = run.close()
        print(report.summary(), flush=True)
    assert report.clean, f"the run left things behind: {report.problems()}"
