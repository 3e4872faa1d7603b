# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv when needed.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup demo test lint unit integration live clean

setup:
	@bash scripts/setup_env.sh

demo: setup
	bash scripts/run_accuracy_test.sh

lint: setup
	$(PY) -m ruff check vllm_qaic_connector vllm_qaic_proxy emulator testbed tests scripts benchmarks
	$(PY) -m mypy
	.venv/bin/lint-imports
	$(PY) scripts/check_docs.py

# Tests by kind (tests/unit, tests/integration, tests/live); `make test` runs them all once.
unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

live: setup
	$(PY) -m pytest -v -rA --durations=60 tests/live

test: setup lint
	$(PY) -m pytest -v -rA --durations=60 tests

clean:
	rm -rf .venv .venv-dynamo .pytest_cache .mypy_cache .ruff_cache .hypothesis .cache

# The proxy against vLLM over 2 x 500 generated requests, 4 conversations at once (CI runs
# 30 of one fleet a day, with the day's seed).
.PHONY: differential
differential: setup
	$(PY) -m testbed.differential --requests $${REQUESTS:-500} --seed $${SEED:-1} \
	  --concurrency $${CONCURRENCY:-4}

# Multi-turn reuse: 8 conversations x 4 turns, shm and NIXL, the prefill's prefix cache on
# and off, each beside the same run without reuse (CI runs the shm, cache-on one).
.PHONY: conversations
conversations: setup
	for t in shm nixl; do for c in "" --no-prefix-caching; do for r in "" --no-reuse; do \
	  $(PY) -m testbed.conversations --transport $$t $$c $$r || exit 1; done; done; done

# Issue #55: bf16 vLLM prefills into float16 QAIC programs over random models (CI: the
# shipped model's case in tests/live/test_qaic_emulator_harness.py).
.PHONY: qaic-dtype-sweep
qaic-dtype-sweep: setup
	$(PY) -m testbed.qaic_dtype_sweep --models 4

# Issue #9 soak: 500 requests at concurrency 16 through 1P1D + proxy, shm then NIXL.
.PHONY: soak
soak: setup
	$(PY) -m testbed.soak --requests 500 --concurrency 16 --transport shm
	$(PY) -m testbed.soak --requests 500 --concurrency 16 --transport nixl

# Issue #13: aggregated vs this connector vs vLLM's NixlConnector, 64 prompts, concurrency 8 and 1,
# and open loop at the aggregated server's throughput.
.PHONY: compare
compare: setup
	$(PY) -m benchmarks.compare_e2e --json compare_e2e.json --plot compare_e2e.png

# Issue #57: multi-turn TTFT per turn, reuse against the same run without it and against
# vLLM alone (aggregated), on a model whose prefill time shows; a plot beside the table.
.PHONY: compare-turns
compare-turns: setup
	$(PY) -m testbed.conversations --scaled --compare --json compare_turns.json --plot compare_turns.png
	$(PY) -m testbed.conversations --scaled --compare --no-prefix-caching --plot compare_turns_no_cache.png

# Issue #71: goodput at TTFT and TPOT targets over a Poisson rate sweep, on the same two
# cores: 1P1D behind the proxy and behind vllm-router, two replicas, one two-core engine.
.PHONY: goodput
goodput: setup
	$(PY) -m benchmarks.goodput --json runs/goodput.json --plot runs/goodput.png

# Issue #71, point 3: the handoff's share of TTFT by prompt length (128 to 4k tokens) on a
# scaled random model, shm and NIXL, the decode's block size the prefill's or another.
.PHONY: handoff-share
handoff-share: setup
	$(PY) -m benchmarks.handoff_share --json runs/handoff_share.json --plot runs/handoff_share.png

# Issue #73: 1P1D behind Dynamo 1.6.1 (frontend + KV router, file discovery, ZMQ KV events)
# on one host, from a venv of its own over .venv's packages (docs/routing.md, "Dynamo").
.PHONY: dynamo
dynamo: setup
	bash scripts/setup_dynamo_env.sh
	$(PY) -m testbed.dynamo_up --prompts $${PROMPTS:-4}
