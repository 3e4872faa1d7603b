#!/usr/bin/env bash
# Prefill/decode handoff between two `vllm serve` instances through QAICConnector, checked
# against the same prompts served aggregated (prefill and decode) by the prefill instance. Last line:
#   accuracy: disagg=X aggregated=Y agreement=Z% prompts=N transport=T
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

MODEL=${MODEL:-$ROOT/models/tiny-copy}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-8}
# Block sizes: one, or one per instance (e.g. "128 32" with two instances).
PREFILL_BLOCK_SIZE=${PREFILL_BLOCK_SIZE:-128}
DECODE_BLOCK_SIZE=${DECODE_BLOCK_SIZE:-128}
# Before the concurrent runs, one request at a time through the proxy after each of these
# idle gaps (seconds; the first right after start-up): each timed, from loaded KV, and
# equal to the aggregated answer. Empty: none.
LONE_GAPS=${LONE_GAPS-0 2 15}
# The first may take a fresh decode's first forward (3-5 s here); a model whose own first
# request is slower (a TP 2 Mamba hybrid: 15 s on a plain vLLM server here) needs more.
LONE_FIRST_MAX_S=${LONE_FIRST_MAX_S:-10}
PREFILLER_TP_SIZE=${PREFILLER_TP_SIZE:-1}
DECODER_TP_SIZE=${DECODER_TP_SIZE:-1}
# 2: the decode serves with --data-parallel-size 2 (one engine per core, one side channel each).
DECODER_DP_SIZE=${DECODER_DP_SIZE:-1}
# xPyD: the proxy round-robins over every (prefill, decode) pair.
NUM_PREFILL_INSTANCES=${NUM_PREFILL_INSTANCES:-1}
NUM_DECODE_INSTANCES=${NUM_DECODE_INSTANCES:-1}
KV_TRANSPORT=${KV_TRANSPORT:-shm}
DECODE_TARGET=${DECODE_TARGET:-vllm}
KV_CACHE_PREFIX=${KV_CACHE_PREFIX:-}
# DECODE_TARGET=qaic: the emulated decode's slots and programs (2: the layers split over two).
QAIC_SLOTS=${QAIC_SLOTS:-32}
QAIC_PROGRAMS=${QAIC_PROGRAMS:-1}
NEGATIVE_CONTROL=${NEGATIVE_CONTROL:-0}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-1024}
# Smaller than the prompts forces chunked prefill on the prefill instance.
PREFILL_MAX_NUM_BATCHED_TOKENS=${PREFILL_MAX_NUM_BATCHED_TOKENS:-}
# KV cache sizes in blocks (--num-gpu-blocks-override). Small ones put an engine under KV
# pressure, where vLLM preempts running requests and recomputes them; the prefill then also
# admits prompts without reserving their whole length (--no-scheduler-reserve-full-isl).
PREFILL_KV_BLOCKS=${PREFILL_KV_BLOCKS:-}
DECODE_KV_BLOCKS=${DECODE_KV_BLOCKS:-}
# The decode's --speculative-config (JSON), e.g. {"method":"ngram","num_speculative_tokens":3}.
DECODE_SPECULATIVE_CONFIG=${DECODE_SPECULATIVE_CONFIG:-}
# The prefill's, e.g. the same: a drafter with KV of its own (EAGLE, MTP) runs on both or is
# refused (the decode then recomputes every prompt and the harness fails).
PREFILL_SPECULATIVE_CONFIG=${PREFILL_SPECULATIVE_CONFIG:-}
ENFORCE_EAGER=${ENFORCE_EAGER:-1}
HMA=${HMA:-1}  # 0: vLLM's hybrid KV cache manager off (full-length KV for every layer)
PREFIX_CACHING=${PREFIX_CACHING:-1}  # 0: --no-enable-prefix-caching (Mamba models on CPU need it)
DTYPE=${DTYPE:-}  # --dtype for every server (vLLM on CPU serves float32 checkpoints in bf16)
# 1: every vLLM server schedules asynchronously, as vLLM does by default on a GPU (its CPU
# platform turns it off; testbed/cpu_async_scheduling.py turns it back on).
ASYNC_SCHEDULING=${ASYNC_SCHEDULING:-0}
ASYNC_SAVES=${ASYNC_SAVES:-1}  # 0: the connector's async_saves off (staging inside the step)
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-420}
KEEP_RUN=${KEEP_RUN:-0}
# On an AMX host, the engine(s) named here (prefill, decode or "prefill decode") see no AMX
# tiles, so they pack KV as an AVX-512 host does (vec) beside the others' amx.
NO_AMX=${NO_AMX:-}

unsupported() { echo "unsupported: $*" >&2; exit 2; }
case "$KV_TRANSPORT" in shm|nixl) ;; *) unsupported "KV_TRANSPORT=$KV_TRANSPORT (shm or nixl)";; esac
[ "$DECODE_TARGET" = vllm ] || [ "$DECODE_TARGET" = qaic ] || unsupported "DECODE_TARGET=$DECODE_TARGET (vllm or qaic)"
case "$PREFILLER_TP_SIZE$DECODER_TP_SIZE" in 11|21|12|22) ;;
  *) unsupported "PREFILLER_TP_SIZE=$PREFILLER_TP_SIZE DECODER_TP_SIZE=$DECODER_TP_SIZE (this machine has 2 cores: TP 1 or 2)";; esac
[ -z "$KV_CACHE_PREFIX" ] || [ "$DECODE_TARGET" = qaic ] || unsupported "KV_CACHE_PREFIX applies to DECODE_TARGET=qaic only"
[ "$DECODE_TARGET" != qaic ] || [ "$PREFILLER_TP_SIZE$DECODER_TP_SIZE" = 11 ] \
  || unsupported "DECODE_TARGET=qaic with TP P=$PREFILLER_TP_SIZE D=$DECODER_TP_SIZE (the QAIC emulator is one rank and reads TP 1 prefills)"
for n in "$NUM_PREFILL_INSTANCES" "$NUM_DECODE_INSTANCES"; do
  [[ "$n" =~ ^[1-4]$ ]] || unsupported "NUM_PREFILL_INSTANCES/NUM_DECODE_INSTANCES=$n (1 to 4)"
done
XPYD=0; [ "$NUM_PREFILL_INSTANCES$NUM_DECODE_INSTANCES" = 11 ] || XPYD=1
[ "$XPYD" = 0 ] || [ "$PREFILLER_TP_SIZE$DECODER_TP_SIZE$DECODE_TARGET" = 11vllm ] \
  || unsupported "several instances need TP 1 and DECODE_TARGET=vllm (this machine has 2 cores)"
case "$DECODER_DP_SIZE" in 1) ;; 2) [ "$DECODER_TP_SIZE$DECODE_TARGET$XPYD" = 1vllm0 ] \
  || unsupported "DECODER_DP_SIZE=2 needs DECODER_TP_SIZE=1, DECODE_TARGET=vllm and one instance each (2 cores)";;
  *) unsupported "DECODER_DP_SIZE=$DECODER_DP_SIZE (1 or 2)";; esac
[ -d "$MODEL" ] || { echo "MODEL=$MODEL is not a local model directory" >&2; exit 2; }
read -r -a P_BLOCKS <<< "$PREFILL_BLOCK_SIZE"; read -r -a D_BLOCKS <<< "$DECODE_BLOCK_SIZE"
read -r -a GAPS <<< "$LONE_GAPS"

bash "$ROOT/scripts/setup_env.sh"
PY="$ROOT/.venv/bin/python"
# Starts a command in a process group of its own (cleanup signals the group), in this session.
# A new session (setsid) would be a new scheduler autogroup, and an autogroup whose worker was
# idle gets almost no CPU on a core where another server's worker spins: that starved a
# co-located prefill's NIXL progress for tens of seconds.
OWN_GROUP=("$PY" -c 'import os, sys; os.setpgid(0, 0); os.execvp(sys.argv[1], sys.argv[1:])')

RUN_ID="qaic$$$(date +%s | tail -c 5)"
RUN_DIR=$(mktemp -d "/tmp/qaic-accuracy.XXXXXX")
ls /dev/shm | sort > "$RUN_DIR/shm_before"
PIDS=()
signal_servers() {  # signal; a server interrupted before its setpgid has no group yet
  for pid in "${PIDS[@]}"; do kill -"$1" -- "-$pid" 2>/dev/null || kill -"$1" "$pid" 2>/dev/null || true; done
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  signal_servers TERM
  # 15 s to finish gracefully; 3 s when interrupted (vLLM acts on SIGTERM only once its
  # engine has started: before, it sat out the whole grace period).
  local grace=30; [ "$rc" = 130 ] && grace=6
  for _ in $(seq 1 "$grace"); do
    alive=0; for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  signal_servers KILL
  rm -f /dev/shm/qaic_kv_"${RUN_ID}"* 2>/dev/null || true
  # vLLM's CPU TP segments and multiprocessing semaphores outlive killed processes; remove
  # the ones that appeared during this run.
  if [ -f "$RUN_DIR/shm_before" ]; then
    comm -13 "$RUN_DIR/shm_before" <(ls /dev/shm | sort) | grep -E '^(vllm_dist_|psm_|sem\.mp-)' \
      | while read -r f; do rm -f "/dev/shm/$f"; done || true
  fi
  if [ "$rc" != 0 ] && [ -d "$RUN_DIR" ]; then
    for log in "$RUN_DIR"/*.log; do echo "--- last lines of $(basename "$log")"; tail -n 15 "$log"; done
  fi
  [ "$KEEP_RUN" = 1 ] && echo "run kept in $RUN_DIR" || rm -rf "$RUN_DIR"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# All ports in one pick, below the ephemeral range: vLLM's own zmq binds (to port 0) cannot take
# one between the pick and its use.
mapfile -t PORTS < <(cd "$ROOT" && "$PY" -m testbed.ports $((NUM_PREFILL_INSTANCES + 2 * NUM_DECODE_INSTANCES + 1)))
next_port() { NEXT_PORT=${PORTS[0]}; PORTS=("${PORTS[@]:1}"); }
P_PORTS=(); D_PORTS=(); D_KV_PORTS=()
for _ in $(seq "$NUM_PREFILL_INSTANCES"); do next_port; P_PORTS+=("$NEXT_PORT"); done
for _ in $(seq "$NUM_DECODE_INSTANCES"); do
  next_port; D_PORTS+=("$NEXT_PORT"); next_port; D_KV_PORTS+=("$NEXT_PORT")
done
P_PORT=${P_PORTS[0]}; D_PORT=${D_PORTS[0]}; D_KV_PORT=${D_KV_PORTS[0]}
next_port; X_PORT=$NEXT_PORT
# STAGE_AT=prefill: the proxy names the decode, so the prefill stages in its layout.
# STAGE_AT=decode: the prefill stages in its own layout and the decode converts.
# ROUTER=proxy: the project's proxy in front. ROUTER=vllm-router: vLLM's Rust P/D router
# (vllm-router 0.1.17, test extras) on the same port; it names no decode, so the prefill
# stages in its own layout (STAGE_AT=decode) unless decode_peers tells it otherwise.
# ROUTER=llm-d: no router process; the client sends each request as llm-d's routing sidecar
# does (testbed/llm_d_sidecar.py: a prefill leg, then the decode leg streamed), 1P1D.
ROUTER=${ROUTER:-proxy}
case "$ROUTER" in proxy|vllm-router|llm-d) ;; *) echo "[harness] ROUTER=$ROUTER: proxy, vllm-router or llm-d"; exit 2;; esac
if [ "$ROUTER" = proxy ]; then STAGE_AT=${STAGE_AT:-prefill}; else STAGE_AT=${STAGE_AT:-decode}; fi
X_URL="http://127.0.0.1:$X_PORT" VIA=()
if [ "$ROUTER" = llm-d ]; then
  [ "$NUM_PREFILL_INSTANCES$NUM_DECODE_INSTANCES$DECODER_DP_SIZE" = 111 ] || unsupported "ROUTER=llm-d runs one prefill and one decode"
  X_URL="http://127.0.0.1:$D_PORT" VIA=(--sidecar "http://127.0.0.1:$P_PORT")
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONUNBUFFERED=1

if [ "$MODEL" = "$ROOT/models/tiny-copy" ]; then TASK=copy; else TASK=text; fi
DEBUG_KEY=""
[ "$NEGATIVE_CONTROL" = 1 ] && DEBUG_KEY=',"debug_corrupt_loaded_kv":true'
[ "$ASYNC_SAVES" = 0 ] && DEBUG_KEY="$DEBUG_KEY"',"async_saves":false'

serve() {  # name cores port block_size tp kv_transfer_config(or empty) [extra vLLM args...]
  # The command line, environment (own TMPDIR and caches under $RUN_DIR/$name, the shared
  # model-info cache) and core pinning come from testbed/serve.py, the one vLLM launcher
  # of the tests and benchmarks; it joins a process group of its own and execs the server.
  local name=$1 core=$2 port=$3 bs=$4 tp=$5 ktc=$6; shift 6
  local opts=(--dir "$RUN_DIR/$name" --core "$core" --port "$port" --model "$MODEL"
              --block-size "$bs" --max-model-len "$MAX_MODEL_LEN" --tp "$tp" --own-group)
  [ "$ENFORCE_EAGER" = 1 ] || opts+=(--no-eager)
  [ "$HMA" = 0 ] && opts+=(--no-hma)
  [ "$PREFIX_CACHING" = 0 ] && opts+=(--no-prefix-caching)
  [ -n "$DTYPE" ] && opts+=(--dtype "$DTYPE")
  [ "$ASYNC_SCHEDULING" = 1 ] && opts+=(--async-scheduling)
  [ -n "$ktc" ] && opts+=(--kv "$ktc")
  [[ " $NO_AMX " == *" ${name%%[0-9]*} "* ]] && opts+=(--no-amx)
  "$PY" -m testbed.serve vllm "${opts[@]}" -- "$@" >"$RUN_DIR/$name.log" 2>&1 &
  PIDS+=($!)
}

ktc() {  # role engine_id side_channel_port
  echo "{\"kv_connector\":\"QAICConnector\",\"kv_role\":\"$1\",\"engine_id\":\"$2\",\"kv_load_failure_policy\":\"fail\",\"kv_connector_extra_config\":{\"transport\":\"$KV_TRANSPORT\",\"side_channel_port\":$3$DEBUG_KEY}}"
}

echo "[harness] $(bash "$ROOT/scripts/host_isa.sh")"
echo "[harness] run $RUN_ID: model=$(basename "$MODEL") prompts=$NUM_PROMPTS concurrency=$CONCURRENCY" \
     "instances P=$NUM_PREFILL_INSTANCES D=$NUM_DECODE_INSTANCES TP P=$PREFILLER_TP_SIZE D=$DECODER_TP_SIZE DP D=$DECODER_DP_SIZE blocks P=$PREFILL_BLOCK_SIZE D=$DECODE_BLOCK_SIZE stage_at=${STAGE_AT:-prefill} transport=$KV_TRANSPORT async_scheduling=$ASYNC_SCHEDULING negative_control=$NEGATIVE_CONTROL"
PREFILL_ARGS=()
[ -n "$PREFILL_MAX_NUM_BATCHED_TOKENS" ] && PREFILL_ARGS=(--max-num-batched-tokens "$PREFILL_MAX_NUM_BATCHED_TOKENS" --enable-chunked-prefill)
[ -n "$PREFILL_KV_BLOCKS" ] && PREFILL_ARGS+=(--num-gpu-blocks-override "$PREFILL_KV_BLOCKS" --no-scheduler-reserve-full-isl)
[ -n "$PREFILL_SPECULATIVE_CONFIG" ] && PREFILL_ARGS+=(--speculative-config "$PREFILL_SPECULATIVE_CONFIG")
# Every prefill on core 0, every decode on core 1 (TP 2 ranks use both).
P_CORES=0; [ "$PREFILLER_TP_SIZE" = 2 ] && P_CORES="0|1"
# QAIC: the decode program's KV dtype is fixed when it is compiled, so the prefill (and the
# aggregated reference) serve in it; vLLM on CPU would downcast the float32 model to bf16.
# With DTYPE set apart from QAIC_DTYPE, the prefill serves in DTYPE (bf16 is vLLM's default)
# and the QAIC decode converts its KV into the program's dtype as it writes the slot.
DTYPE_ARGS=(); [ "$DECODE_TARGET" = qaic ] && [ -z "$DTYPE" ] && DTYPE_ARGS=(--dtype "${QAIC_DTYPE:-float32}")
CONVERTS=0; [ "$DECODE_TARGET" = qaic ] && [ -n "$DTYPE" ] && [ "$DTYPE" != "${QAIC_DTYPE:-float32}" ] && CONVERTS=1
D_CORES=1; [ "$DECODER_TP_SIZE$DECODER_DP_SIZE" != 11 ] && D_CORES="0|1"
D_ARGS=(); [ "$DECODER_DP_SIZE" = 2 ] && D_ARGS=(--data-parallel-size 2)
[ -n "$DECODE_KV_BLOCKS" ] && D_ARGS+=(--num-gpu-blocks-override "$DECODE_KV_BLOCKS")
[ -n "$DECODE_SPECULATIVE_CONFIG" ] && D_ARGS+=(--speculative-config "$DECODE_SPECULATIVE_CONFIG")
for i in "${!P_PORTS[@]}"; do
  serve "prefill$i" "$P_CORES" "${P_PORTS[$i]}" "${P_BLOCKS[i % ${#P_BLOCKS[@]}]}" "$PREFILLER_TP_SIZE" \
    "$(ktc kv_producer "${RUN_ID}p$i" 0)" "${PREFILL_ARGS[@]}" "${DTYPE_ARGS[@]}"
done
if [ "$DECODE_TARGET" = qaic ]; then
  # The QAIC decode emulator plays the decode engine on core 1: QAIC_SLOTS batch slots of
  # MAX_MODEL_LEN tokens in /dev/shm (qaic_kv_${RUN_ID}d_*), same HTTP API, its own /metrics.
  # KV_TRANSPORT=nixl: its slot buffers are registered with NIXL and READs land in slot k.
  QAIC_ARGS=(--model "$MODEL" --port "$D_PORT" --side-channel-port "$D_KV_PORT"
             --slots "$QAIC_SLOTS" --ctx "$MAX_MODEL_LEN" --engine-id "${RUN_ID}d"
             --dtype "${QAIC_DTYPE:-float32}" --transport "$KV_TRANSPORT" --programs "$QAIC_PROGRAMS")
  [ -n "$KV_CACHE_PREFIX" ] && QAIC_ARGS+=(--kv-cache-prefix "$KV_CACHE_PREFIX")
  [ "$NEGATIVE_CONTROL" = 1 ] && QAIC_ARGS+=(--corrupt)
  mkdir -p "$RUN_DIR/decode0/tmp"
  TMPDIR="$RUN_DIR/decode0/tmp" VLLM_CACHE_ROOT="$RUN_DIR/decode0/cache" \
    "${OWN_GROUP[@]}" taskset -c 1 "$PY" -m emulator.qaic_emulator "${QAIC_ARGS[@]}" >"$RUN_DIR/decode0.log" 2>&1 &
  PIDS+=($!)
else
  for j in "${!D_PORTS[@]}"; do
    serve "decode$j" "$D_CORES" "${D_PORTS[$j]}" "${D_BLOCKS[j % ${#D_BLOCKS[@]}]}" "$DECODER_TP_SIZE" \
      "$(ktc kv_consumer "${RUN_ID}d$j" "${D_KV_PORTS[$j]}")" "${D_ARGS[@]}"
  done
fi
PROXY_ARGS=(--routing pairs --prefill) DECODE_URLS=() DECODE_KVS=()
for port in "${P_PORTS[@]}"; do PROXY_ARGS+=("http://127.0.0.1:$port"); done
for j in "${!D_PORTS[@]}"; do
  DECODE_URLS+=("http://127.0.0.1:${D_PORTS[$j]}"); DECODE_KVS+=("127.0.0.1:${D_KV_PORTS[$j]}")
done
PROXY_ARGS+=(--decode "${DECODE_URLS[@]}")
[ "$STAGE_AT" = prefill ] && PROXY_ARGS+=(--decode-kv "${DECODE_KVS[@]}")
if [ "$ROUTER" = vllm-router ]; then
  ROUTER_BIN="$(dirname "$PY")/vllm-router"; [ -x "$ROUTER_BIN" ] || ROUTER_BIN=$(command -v vllm-router || true)
  [ -n "$ROUTER_BIN" ] || { echo "[harness] vllm-router is not installed (scripts/setup_env.sh brings it)"; exit 1; }
  ROUTER_ARGS=(--vllm-pd-disaggregation --host 127.0.0.1 --port "$X_PORT" --policy round_robin)
  for port in "${P_PORTS[@]}"; do ROUTER_ARGS+=(--prefill "http://127.0.0.1:$port"); done
  for url in "${DECODE_URLS[@]}"; do ROUTER_ARGS+=(--decode "$url"); done
  "${OWN_GROUP[@]}" "$ROUTER_BIN" "${ROUTER_ARGS[@]}" >"$RUN_DIR/router.log" 2>&1 &
  PIDS+=($!)
elif [ "$ROUTER" = proxy ]; then
  "${OWN_GROUP[@]}" "$PY" -m vllm_qaic_proxy --port "$X_PORT" "${PROXY_ARGS[@]}" >"$RUN_DIR/proxy.log" 2>&1 &
  PIDS+=($!)
fi

# Bash runs a trap only once its foreground command ends: a SIGINT or SIGTERM sent to this
# script alone (a CI runner's cancel, `kill`) waited for every server to be ready before it
# stopped them. A command run in the background and waited for is cut short by the trap.
interruptible() { "$@" & wait $!; }
wait_ready() {  # name port: the launcher's readiness wait; fails when any server of the run exits
  interruptible "$PY" -m testbed.serve wait "$1" "$2" "$STARTUP_TIMEOUT" "${PIDS[@]}" || exit 1
}
for i in "${!P_PORTS[@]}"; do wait_ready "prefill$i" "${P_PORTS[$i]}"; done
for j in "${!D_PORTS[@]}"; do wait_ready "decode$j" "${D_PORTS[$j]}"; done
[ "$ROUTER" = llm-d ] || wait_ready "$ROUTER" "$X_PORT"
# Which KV packing each engine's connector found (vLLM CPU's differs by host, dtype, head size),
for log in "$RUN_DIR"/prefill*.log "$RUN_DIR"/decode*.log; do
  # and the KV dtype each computes in (a QAIC program's: its buffers')
  { grep -o -m1 -E "dtype=torch\.[a-z0-9]+|[a-z0-9]+ KV buffers" "$log"
    grep -o -E "vLLM CPU attention ISA [a-z0-9_]+ packs KV as [A-Za-z0-9_]+" "$log" | sort -u
    grep -o -E "[A-Za-z0-9_]+ layout, [0-9]+ layers, block [0-9]+" "$log" | sort -u
  } 2>/dev/null | sed "s/^/[harness] $(basename "$log" .log): /" || true
done

run_prompts() {  # label url out num_prompts [extra args]
  interruptible "$PY" -m scripts.accuracy_check run --label "$1" --url "$2" --model model --task "$TASK" --model-dir "$MODEL" \
    --num-prompts "$4" --concurrency "$CONCURRENCY" --out "$3" --prompts-file "$RUN_DIR/prompts.json" "${@:5}"
}
DECODE_METRICS_URLS=(); for port in "${D_PORTS[@]}"; do DECODE_METRICS_URLS+=("http://127.0.0.1:$port"); done
# First, as a user meets a fresh pair: single requests with idle time before each (the
# prompts after the concurrent run's).
LONE_ARGS=()
if [ ${#GAPS[@]} -gt 0 ]; then
  run_prompts lone "$X_URL" "$RUN_DIR/lone.json" 0 --offset "$NUM_PROMPTS" "${VIA[@]}" \
    --gaps "${GAPS[@]}" --decode-urls "${DECODE_METRICS_URLS[@]}"
  LONE_ARGS=(--lone "$RUN_DIR/lone.json" --lone-first-max-s "$LONE_FIRST_MAX_S")
fi
# The reference: the prefill instance serves the prompts itself (a plain request leaves its
# connector idle), salted so that it shares no prefix-cache block with the handoffs. One
# server fewer than a separate aggregated instance: start-up is most of a run's time here.
run_prompts aggregated "http://127.0.0.1:$P_PORT" "$RUN_DIR/agg.json" $((NUM_PROMPTS + ${#GAPS[@]})) --cache-salt reference
run_prompts disaggregated "$X_URL" "$RUN_DIR/disagg.json" "$NUM_PROMPTS" "${VIA[@]}"
sleep 1  # let the last step's connector stats reach the metrics endpoint
METRICS=()
for j in "${!D_PORTS[@]}"; do
  curl -sf "http://127.0.0.1:${D_PORTS[$j]}/metrics" >"$RUN_DIR/decode${j}_metrics.txt"
  METRICS+=("$RUN_DIR/decode${j}_metrics.txt")
done
# With several prefills, every decode must have loaded KV from every one of them.
PEER_ARGS=(); [ "$NUM_PREFILL_INSTANCES" -gt 1 ] && PEER_ARGS=(--expect-peers "$NUM_PREFILL_INSTANCES")

MIN_ACC=0.95; [ "$TASK" = text ] && MIN_ACC=0
# QAIC: agreement >= 99% (transformers decodes, not vLLM's kernels); more gates below.
MIN_AGREEMENT=100; [ "$DECODE_TARGET" = qaic ] && MIN_AGREEMENT=99
# Converted KV (bf16 prefill, float16 program) decodes in other precision than the
# aggregated bf16 reference: 99% of its tokens must agree (issue 55), not every answer.
MIN_TOKENS=0; [ "$CONVERTS" = 1 ] && MIN_AGREEMENT=0 && MIN_TOKENS=99
set +e
"$PY" -m scripts.accuracy_check verdict --disagg "$RUN_DIR/disagg.json" --agg "$RUN_DIR/agg.json" \
  --decode-metrics "${METRICS[@]}" "${PEER_ARGS[@]}" "${LONE_ARGS[@]}" --transport "$KV_TRANSPORT" --min-accuracy "$MIN_ACC" \
  --min-agreement "$MIN_AGREEMENT" --min-token-agreement "$MIN_TOKENS" > "$RUN_DIR/verdict.txt"
status=$?
set -e
# Every request has finished: no instance may still hold KV blocks (the prefill's are held
# for the saves that run after its steps, then given back).
LEAK_URLS=()
for port in "${P_PORTS[@]}"; do LEAK_URLS+=("prefill:$port"); done
[ "$DECODE_TARGET" = vllm ] && for port in "${D_PORTS[@]}"; do LEAK_URLS+=("decode:$port"); done
for entry in "${LEAK_URLS[@]}"; do
  metrics=$(curl -sf "http://127.0.0.1:${entry#*:}/metrics")
  usage=$(awk '$1 ~ /^vllm:kv_cache_usage_perc/ { s += $2 } END { printf "%g", s }' <<<"$metrics")
  count() { awk -v n="$1" 'index($1, n) == 1 { s += $2 } END { printf "%d", s }' <<<"$metrics"; }
  echo "${entry%%:*} :${entry#*:} KV cache usage after the run: $usage" \
       "preemptions=$(count vllm:num_preemptions_total) of them handoffs=$(count vllm:qaic_kv_preempted_handoffs_total)"
  if [ -n "$DECODE_SPECULATIVE_CONFIG" ] && [ "${entry%%:*}" = decode ]; then
    echo "decode :${entry#*:} speculative tokens accepted=$(count vllm:spec_decode_num_accepted_tokens_total)" \
         "of drafted=$(count vllm:spec_decode_num_draft_tokens_total)"
  fi
  if [ "$usage" != 0 ]; then echo "FAIL: ${entry%%:*} on port ${entry#*:} still holds KV blocks"; status=1; fi
done > "$RUN_DIR/usage.txt"
if [ "$ASYNC_SCHEDULING" = 1 ]; then  # every vLLM server went through the launcher that keeps it
  servers=$(ls "$RUN_DIR"/prefill*.log "$RUN_DIR"/decode*.log 2>/dev/null | wc -l)
  [ "$DECODE_TARGET" = qaic ] && servers=${#P_PORTS[@]}
  kept=$(grep -l '^\[testbed\] async scheduling kept True' "$RUN_DIR"/*.log | wc -l)
  echo "async scheduling (batch queue of 2, as on a GPU) in $kept of $servers vLLM servers" >> "$RUN_DIR/usage.txt"
  [ "$kept" = "$servers" ] || echo "FAIL: async scheduling is off in some vLLM server" >> "$RUN_DIR/usage.txt"
fi
grep -q '^FAIL:' "$RUN_DIR/usage.txt" && status=1
{ sed '$d' "$RUN_DIR/verdict.txt"; cat "$RUN_DIR/usage.txt"; tail -n 1 "$RUN_DIR/verdict.txt"; } > "$RUN_DIR/verdict.all"
mv "$RUN_DIR/verdict.all" "$RUN_DIR/verdict.txt"
if [ "$DECODE_TARGET" = qaic ]; then
  # QAIC gates: accuracy equal to the aggregated run's, every slot free again. Also reports
  # the handoff's host copies.
  curl -sf "http://127.0.0.1:$P_PORT/metrics" >"$RUN_DIR/prefill_metrics.txt"
  qm() { awk -v n="$2" '$1 == n || index($1, n "{") == 1 { s += $2 } END { printf "%.0f", s }' "$1"; }
  D="$RUN_DIR/decode0_metrics.txt"
  reqs=$(qm "$D" vllm:qaic_kv_loaded_requests_total); reqs=$(( reqs > 0 ? reqs : 1 ))
  staged=$(qm "$RUN_DIR/prefill_metrics.txt" vllm:qaic_kv_bytes_copied_total)
  host=$(qm "$D" vllm:qaic_kv_bytes_copied_total); dma=$(qm "$D" vllm:qaic_kv_dma_bytes_total)
  in_use=$(qm "$D" vllm:qaic_slots_in_use)
  acc_d="" acc_a=""
  read -r acc_d acc_a < <(sed -n 's/^accuracy: disagg=\([^ ]*\) aggregated=\([^ ]*\) .*/\1 \2/p' "$RUN_DIR/verdict.txt") || true
  {
    sed '$d' "$RUN_DIR/verdict.txt"
    echo "qaic decode: slots=$(qm "$D" vllm:qaic_slots_total) max_in_use=$(qm "$D" vllm:qaic_slots_in_use_max)" \
         "in_use_at_end=$in_use slot_waits=$(qm "$D" vllm:qaic_kv_slot_waits_total) kv_cache_prefix=${KV_CACHE_PREFIX:-none}" \
         "programs=$QAIC_PROGRAMS NIXL descriptors per handoff=$(( $(qm "$D" vllm:qaic_kv_read_descriptors_total) / reqs ))"
    echo "handoff bytes per request: prefill staging write=$((staged / reqs)) emulator host copy=$((host / reqs))" \
         "slot DMA [k,:,0:n,:]=$((dma / reqs)) (= the prompt's KV); host copies per handoff:" \
         "$(awk -v a="$staged" -v b="$host" -v c="$dma" 'BEGIN { printf "%.2f", c ? (a + b) / c : 0 }')"
    [ "$in_use" = 0 ] || echo "FAIL: $in_use decode slots still in use after every request finished"
    [ "$acc_d" = "$acc_a" ] || [ "$CONVERTS" = 1 ] || echo "FAIL: QAIC accuracy $acc_d differs from aggregated $acc_a"
    tail -n 1 "$RUN_DIR/verdict.txt"
  } > "$RUN_DIR/verdict.qaic" && mv "$RUN_DIR/verdict.qaic" "$RUN_DIR/verdict.txt"
  grep -q '^FAIL:' "$RUN_DIR/verdict.txt" && status=1
fi
if [ "$NEGATIVE_CONTROL" = 1 ]; then
  grep -v '^accuracy:' "$RUN_DIR/verdict.txt"
  if [ $status = 0 ]; then echo "NEGATIVE CONTROL: corrupted KV passed the gates; the harness cannot detect bad KV"
  else echo "NEGATIVE CONTROL: corrupted KV was detected (expected); exiting non-zero"; fi
  tail -n 1 "$RUN_DIR/verdict.txt"
  exit 1
fi
cat "$RUN_DIR/verdict.txt"
exit $status
