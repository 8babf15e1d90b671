#!/usr/bin/env bash
# GPU end to end, on a machine with GPUs and, in ./.whl, the wheels it lacks (nixl, pyzmq, msgspec,
# the test plugins). Usage, from the project root:
#   tools/gpu_e2e.sh tests          # the whole suite with CUDA: gpu kernel tests + integration on CUDA pools
#   tools/gpu_e2e.sh cuda           # EVERY CUDA-only test, one line of counts each (< 8 min): the first call of a round
#   tools/gpu_e2e.sh integrity      # ONE GPU: integrity on/off A/B rows (cost %), the vLLM core's false failures (< 4 min)
#   tools/gpu_e2e.sh bench 1:1 2:1  # tools/bench_transfer.py sweeps for the listed P:D scenarios
#   tools/gpu_e2e.sh strided        # paged KV layouts: compiled kernel tests, CUDA matrix, bench_kernels by layout
#   tools/gpu_e2e.sh percall        # per-room overhead on one GPU: direct/staged c1/c8 with --trace (< 8 min)
#   tools/gpu_e2e.sh host-threads   # the host path with and without NIXL's posting threads (< 8 min)
#   tools/gpu_e2e.sh goals          # the docs/PERF.md goals on TWO GPUs: the last group's steps, then the c1/c8 table (< 8 min)
#   tools/gpu_e2e.sh pagetables     # TWO GPUs: the goal table's rows over realistic/scattered/contiguous page tables (< 8 min)
#   tools/gpu_e2e.sh pipeline       # TWO GPUs: staged chunks cut in 8/16/32-layer groups, A/B against whole, c1 and c8 (< 5 min)
#   tools/gpu_e2e.sh kernelpath     # ONE GPU is enough: the kernel path's CUDA tests, then its bench against raw NIXL (< 3 min)
#   tools/gpu_e2e.sh goalrows       # ONE GPU: every goal row of issues 40 and 41 (page tables, small rooms with traces, capacity, tails) (< 9.5 min)
#   tools/gpu_e2e.sh kernelrows     # ONE GPU: the goal rows the kernel path moves (copy alone, page tables, vLLM tail, small rooms) (< 9 min)
#   tools/gpu_e2e.sh copycheck      # ONE GPU: the copy kernel's launch shapes alone, tests named in RERUN, integrity on the kernel path (< 7 min)
# Results go to $OUT (or ./gpu-out) as one JSON line per benchmark run plus the printed lines.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
# the package maps kernels/ to transfer_engine.kernels at install time; without installing, link it
[ -e transfer_engine/kernels ] || ln -s ../kernels transfer_engine/kernels
nvidia-smi -L | tee -a "$OUT/gpu.txt"

phase=${1:-tests}
shift || true
[ "$phase" = vllm ] && exec tools/gpu_vllm.sh "$@"  # the vLLM connector core on CUDA KV caches (< 8 min)

if [ "$phase" = onetest ]; then
  TE_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider "$@" 2>&1 | grep -v "NIXL INFO" | grep -E "Error|error|assert|FAILED|passed|failed" | head -30
  exit 0
fi
if [ "$phase" = layerwise ] || [ "$phase" = layer-calls ]; then  # layer-wise sending (one GPU is enough): the per-layer call
  # against chunk-level and the CUDA calls it makes (< 2 min); then (layerwise) the tail and the forward (< 8 min in all)
  timeout 100 python3 tools/bench_layer_calls.py --device cuda --base none --rooms 20 --rounds 1 2>&1 | grep -v "NIXL INFO" \
    | tee "$OUT/layer-calls.txt" | tail -10
  [ "$phase" = layer-calls ] && exit 0
  for path in direct host; do
    timeout 180 python3 tools/bench_layerwise.py --device cuda --path $path --per-write 1,4 --reps 3 2>&1 \
      | grep -v "NIXL INFO" | tee "$OUT/layerwise-$path.txt" | tail -14
  done
  exit 0
fi
if [ "$phase" = host-threads ]; then  # host WRITEs spread over NIXL's posting threads, A/B against one (< 8 min)
  QWEN="--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"
  for v in "" "num_threads=0"; do
    for c in 1 8; do
      echo "== bench_transfer path=host c$c TE_NIXL_PARAMS=$v"
      TE_NIXL_PARAMS="$v" TE_RING_BYTES=8589934592 timeout 150 python3 tools/bench_transfer.py $QWEN --path host \
        --concurrency $c --rooms $((c == 1 ? 6 : 16)) --rounds 3 --lat-rooms 20 2>&1 | grep -v "NIXL INFO" | grep -E "^path=|rror"
    done
    echo "== bench_layerwise path=host TE_NIXL_PARAMS=$v"
    TE_NIXL_PARAMS="$v" timeout 200 python3 tools/bench_layerwise.py --device cuda --path host --tokens 1024,4096 \
      --per-write 1,4 --reps 3 --room-timeout 20 2>&1 | grep -v "NIXL INFO" | tail -12
  done
  exit 0
fi
if [ "$phase" = layerwise-pairs ]; then  # TTFT chunk-level vs layer-wise, request by request (< 6 min)
  SB="--device cuda --model-hidden 2048 --model-layers 16 --model-heads 16 --model-kv-heads 8 --model-head-dim 128
      --model-ffn 5632 --long 4096 --chunk-tokens 512 --max-batch-tokens 1024 --samples ${SAMPLES:-9} --phases ttft --layerwise-ab"
  for path in ${PATHS:-direct host}; do
    echo "== path=$path, pairs"
    timeout 170 python3 tools/serving_bench.py $SB --engine path=$path --json-out "$OUT/serving-pairs-$path.json" 2>&1 \
      | grep -v "NIXL INFO" | grep -iE "A/B|error|failed|Traceback" | head -12
  done
  exit 0
fi
if [ "$phase" = layerwise-serving ]; then  # TTFT with and without --layerwise, host and device path (< 8 min)
  SB="--device cuda --model-hidden 2048 --model-layers 16 --model-heads 16 --model-kv-heads 8 --model-head-dim 128
      --model-ffn 5632 --long 4096 --chunk-tokens 512 --max-batch-tokens 1024 --samples 8 --window 1 --rounds 1"
  for path in host direct; do
    for lw in "" --layerwise; do
      echo "== path=$path $lw"
      timeout 110 python3 tools/serving_bench.py $SB --engine path=$path $lw --json-out "$OUT/serving-$path$lw.json" \
        2>&1 | grep -v "NIXL INFO" | grep -iE "ttft|prompt|tail|error|failed|Traceback" | head -12
    done
  done
  exit 0
fi
if [ "$phase" = pagetables ]; then  # page tables as serving hands them out: TWO GPUs, one call (< 8 min)
  # Every row of docs/PERF.md's goal table the code produces, each from its own run with the raw NIXL
  # ceiling of that run and the page-table shape named: the layer-wise tail first, then bench_transfer
  # rows (Qwen3-32B-shaped 1.07 GB rooms) in order of importance until BUDGET s are spent; direct with
  # NIXL_UCX_SGL_ENABLE=1 (UCX's batched copies) beside unset. One markdown row per line in
  # $OUT/pagetables.md, every run's JSON in $OUT/pagetables.jsonl, every log as $OUT/pt-*.log.
  # (PT_ARGS / PT_LAYERWISE replace the sizes and device: a dry run on CPU with small rooms)
  QWEN=${PT_ARGS:-"--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"}
  QWEN="$QWEN --json"
  LW=${PT_LAYERWISE:-"--device cuda --tokens 1024,4096,16384"}
  export TE_RING_BYTES=${TE_RING_BYTES:-4294967296}
  start=$SECONDS
  budget=${BUDGET:-360}
  : >"$OUT/pagetables.md"
  if [ "$LW" != none ]; then  # (PT_LAYERWISE=none: no layer-wise rows)
    echo "| measure | page table | tokens | tail ms | raw group WRITE ms | over ms |" | tee -a "$OUT/pagetables.md"
    timeout 150 python3 tools/bench_layerwise.py $LW --path auto --page-table realistic \
      --per-write 1 --reps 4 --room-timeout 20 >"$OUT/pt-layerwise.log" 2>&1 \
      || echo "bench_layerwise rc=$? (see $OUT/pt-layerwise.log)"
    awk '$3 == "layers" { printf "| layer-wise tail, %s %s | %s | %s | %s | %s | %s |\n", $3, $4, $NF, $1, $5, $8, $9 }' \
      "$OUT/pt-layerwise.log" | tee -a "$OUT/pagetables.md"
  fi
  echo "| row | path asked (taken) | page table | P->D | in flight | NIXL_UCX_SGL_ENABLE | engine / raw (rounds) | engine GB/s | raw GB/s | descriptors/room | small room added ms (raw p50) | small room p50 / p99 ms | CPU ms/room prefill (loop), decode (loop) | GC full collections ms (prefill, decode) | mismatches | why (the decode's choice) |" \
    | tee -a "$OUT/pagetables.md"
  row() {  # row NAME SGL ARGS...: one bench_transfer run, one markdown row (PT_ROWS, if set: only the rows it names)
    local name=$1 sgl=$2
    shift 2
    local rows
    rows=$(echo ${PT_ROWS:-})  # (one space between names, whatever the caller's line breaks)
    [ -n "$rows" ] && [[ " $rows " != *" $name "* ]] && return
    if [ $((SECONDS - start)) -gt "$budget" ]; then
      echo "| $name | skipped: the phase's $budget s were spent |" | tee -a "$OUT/pagetables.md"
      return
    fi
    if [ "$sgl" = 1 ]; then
      NIXL_UCX_SGL_ENABLE=1 timeout 90 python3 tools/bench_transfer.py $QWEN "$@" >"$OUT/pt-$name.log" 2>&1
    else
      env -u NIXL_UCX_SGL_ENABLE timeout 90 python3 tools/bench_transfer.py $QWEN "$@" >"$OUT/pt-$name.log" 2>&1
    fi
    local rc=$?
    # (a child's exit message may end without a newline: the JSON is found anywhere on its line)
    grep -o '{"room_bytes".*' "$OUT/pt-$name.log" >>"$OUT/pagetables.jsonl"
    python3 - "$name" "$sgl" "$rc" "$OUT/pt-$name.log" <<'EOF' | tee -a "$OUT/pagetables.md"
import json, sys
name, sgl, rc, log = sys.argv[1:]
lines = [line[line.index('{"room_bytes"'):] for line in open(log) if '{"room_bytes"' in line]
if not lines:
    tail = [line.strip() for line in open(log) if "NIXL INFO" not in line][-3:]
    print(f"| {name} | failed, rc {rc}: {' / '.join(tail)} |")
    sys.exit(0)
r = json.loads(lines[-1])
gc = r.get("gc", {})
full = ", ".join(f"{gc[s]['full']} / {gc[s]['full_total_ms']:.1f}" for s in ("prefill", "decode") if s in gc)
cpu = r.get("cpu_ms_per_room", {})
cpu = ", ".join(f"{cpu[s]['process']:.2f} ({cpu[s]['loop']:.2f})" for s in ("prefill", "decode") if s in cpu)
print(
    f"| {name} | {r['path']} ({r['engine_path']}) | {r['page_table']} | {r['P']}->{r['D']} | {r['concurrency']} "
    f"| {'1' if sgl == '1' else 'unset'} | {r['throughput_ratio']:.2f} ({', '.join(map(str, r['round_ratios']))}) "
    f"| {r['engine_gbps']:.1f} | {r['raw_gbps']:.1f} | {r['descriptors_per_room']:.0f} "
    f"| {r['added_latency_p50_ms']:.3f} ({r['raw_lat_p50_ms']:.3f}) "
    f"| {r['engine_lat_p50_ms']:.3f} / {r['engine_lat_p99_ms']:.3f} | {cpu} | {full} | {r['mismatches']} "
    f"| {'; '.join(r.get('engine_path_reasons', []))} |"
)
EOF
  }
  C1="--concurrency 1 --rooms 4 --rounds 2 --lat-rooms 20"
  C8="--concurrency 8 --rooms 16 --rounds 2 --lat-rooms 8"
  row auto-realistic-c8 0 --path auto --page-table realistic $C8
  row auto-realistic-c1 0 --path auto --page-table realistic $C1
  row direct-contiguous-c1 0 --path direct --page-table contiguous $C1
  row direct-contiguous-c8 0 --path direct --page-table contiguous $C8
  row staged-realistic-c1 0 --path staged --page-table realistic $C1
  row staged-realistic-c8 0 --path staged --page-table realistic $C8
  row direct-contiguous-c1-sgl 1 --path direct --page-table contiguous $C1
  row direct-contiguous-c8-sgl 1 --path direct --page-table contiguous $C8
  row p1d2-staged-realistic-c1 0 --path staged --page-table realistic --prefill-tp 1 --decode-tp 2 \
    --concurrency 1 --rooms 2 --rounds 1 --lat-rooms 20
  row direct-realistic-c8-sgl 1 --path direct --page-table realistic $C8
  row direct-realistic-c8 0 --path direct --page-table realistic $C8
  row auto-scattered-c8 0 --path auto --page-table scattered $C8
  row auto-scattered-c1 0 --path auto --page-table scattered $C1
  row auto-realistic-c8-page1 0 --path auto --page-table realistic $C8 --page-size 1
  row auto-realistic-c1-page1 0 --path auto --page-table realistic $C1 --page-size 1
  row auto-scattered-c8-page1 0 --path auto --page-table scattered $C8 --page-size 1
  echo "pagetables: $((SECONDS - start)) s"
  exit 0
fi
if [ "$phase" = pipeline ]; then  # the staged path pipelined inside a room: TWO GPUs, one call (< 5 min)
  # Qwen3-32B-shaped 1.07 GB rooms (one chunk each) over a realistic page table on the staged path,
  # prefill on GPU 0 and decode on GPU 1. For 1 and 8 rooms in flight and each group size in PL_GROUPS
  # (of 64 layers), one bench_transfer run with --ab cut: its even rounds write each chunk as groups of
  # that many layers (TE_STAGED_PIPELINE_LAYERS), its odd rounds whole, in the same processes, each
  # round against the raw NIXL ceiling taken just before it. One markdown row per run in
  # $OUT/pipeline.md, every run's JSON in $OUT/pipeline.jsonl, every log as $OUT/pl-*.log.
  # (PL_ARGS, PL_GROUPS and TE_PIPELINE_MIN_BYTES replace the sizes and device, the group sizes and the
  # bar: a dry run on CPU with small rooms. The default of staged_pipeline_layers is set from the
  # cut / whole column: transfer_engine/config.py; docs/DECISIONS.md, "Staged-path chunks cut by the
  # prefill room".)
  QWEN=${PL_ARGS:-"--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"}
  QWEN="$QWEN --json --path staged --page-table realistic --ab cut"
  export TE_RING_BYTES=${TE_RING_BYTES:-4294967296}
  start=$SECONDS
  budget=${BUDGET:-200}
  : >"$OUT/pipeline.md"
  echo "| staged, groups of | in flight | page table | cut: engine / raw (rounds) | whole: engine / raw (rounds) | cut / whole | room p50 ms cut / whole | WRITEs/room cut / whole | raw GB/s | mismatches |" \
    | tee -a "$OUT/pipeline.md"
  echo "|---|---|---|---|---|---|---|---|---|---|" | tee -a "$OUT/pipeline.md"
  for conc in 1 8; do
    if [ "$conc" = 1 ]; then
      runs="--concurrency 1 --rooms 8 --rounds 4 --lat-rooms 4"
    else
      runs="--concurrency 8 --rooms 32 --rounds 4 --lat-rooms 4"
    fi
    for g in ${PL_GROUPS:-8 16 32}; do
      name=g$g-c$conc
      if [ $((SECONDS - start)) -gt "$budget" ]; then
        echo "| $g | $conc | skipped: the phase's $budget s were spent |" | tee -a "$OUT/pipeline.md"
        continue
      fi
      TE_STAGED_PIPELINE_LAYERS=$g timeout 75 python3 tools/bench_transfer.py $QWEN $runs >"$OUT/pl-$name.log" 2>&1
      rc=$?
      grep -o '{"room_bytes".*' "$OUT/pl-$name.log" >>"$OUT/pipeline.jsonl"
      python3 - "$g" "$conc" "$rc" "$OUT/pl-$name.log" <<'EOF' | tee -a "$OUT/pipeline.md"
import json, sys
g, conc, rc, log = sys.argv[1:]
lines = [line[line.index('{"room_bytes"'):] for line in open(log) if '{"room_bytes"' in line]
if not lines:
    tail = [line.strip() for line in open(log) if "NIXL INFO" not in line][-3:]
    print(f"| {g} | {conc} | failed, rc {rc}: {' / '.join(tail)} |")
    sys.exit(0)
r = json.loads(lines[-1])
on, off = r["ab"]["on"], r["ab"]["off"]
gain = f"{on['ratio'] / off['ratio']:.2f}" if on["ratio"] and off["ratio"] else "-"
print(
    f"| {g} | {r['concurrency']} | {r['page_table']} | {on['ratio']} ({', '.join(map(str, on['rounds']))}) "
    f"| {off['ratio']} ({', '.join(map(str, off['rounds']))}) | {gain} | {on['room_p50_ms']} / {off['room_p50_ms']} "
    f"| {on['writes_per_room']} / {off['writes_per_room']} | {r['raw_gbps']:.1f} | {r['mismatches']} |"
)
EOF
    done
  done
  echo "pipeline: $((SECONDS - start)) s"
  exit 0
fi
if [ "$phase" = goals ]; then  # the docs/PERF.md goals, for a machine with two GPUs (prefill on 0, decode on 1)
  # 16: the tail's `over` and every step of the last layer group (--steps), at 1K, 4K and 16K tokens
  timeout 200 python3 tools/bench_layerwise.py --device cuda --path direct --tokens 1024,4096,16384 --per-write 1,4 \
    --reps 6 --room-timeout 20 --steps 2>&1 | grep -v "NIXL INFO" | grep -v "peer copy" | tee "$OUT/goals-16.txt" | tail -40
  # 17: the issue's table (direct and staged, 1 and 8 rooms in flight, Qwen3-32B-shaped 1.07 GB rooms)
  for path in direct staged; do for conc in 1 8; do
    TE_RING_BYTES=4294967296 timeout 100 python3 tools/bench_transfer.py --layers 64 --heads 8 --head-dim 128 \
      --page-size 16 --tokens 4096 --chunks 1 --device cuda --path $path --concurrency $conc \
      --rooms $([ $conc = 1 ] && echo 6 || echo 16) --rounds 3 --lat-rooms $([ $conc = 1 ] && echo 30 || echo 16) 2>&1 \
      | grep -v "NIXL INFO" | grep "^path=" | tee -a "$OUT/goals-17.txt"
  done; done
  exit 0
fi
if [ "$phase" = trace ]; then  # where a room's time goes (bench_transfer.py --trace)
  QWEN="--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"
  for a in "${@:-direct 1 6}"; do
    set -- $a
    timeout 200 python3 tools/bench_transfer.py $QWEN --trace --path $1 --concurrency $2 --rooms $3 --rounds 3 \
      --lat-rooms 50 2>&1 | grep -v "NIXL INFO" | tee "$OUT/trace-$1-$2.txt" | grep -E "^path=|post_write|planned|ready|posted|notif"
  done
  exit 0
fi
if [ "$phase" = strided ]; then  # paged KV views in the compiled kernels, then contiguous vs paged rates
  python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -3 | tee -a "$OUT/strided.txt"
  TE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/integration/test_matrix_strided.py 2>&1 \
    | tail -3 | tee -a "$OUT/strided.txt"
  timeout 360 python3 tools/bench_kernels.py --passes 2 --no-host --models qwen3-32b,mla-61x576 --splits 4:2,8:1 \
    --layouts contiguous,vllm_cpu,flash_nhd,flash_hnd --json "$OUT/bench-strided.json" 2>&1 \
    | grep -v "^  pass" | tee -a "$OUT/strided.txt"
  exit 0
fi
if [ "$phase" = percall ]; then  # per-room overhead on ONE GPU (both processes on cuda:0): direct and staged, c1 and c8,
  # with --trace, each run an A/B in the same processes (bench_transfer --ab: even rounds and small-room
  # samples on, odd ones off): the completion waiter's thread (else polls), and for staged the region
  # granted with the request. The ring holds four rooms (a room is granted ahead only within half of it).
  QWEN="--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device ${DEV:-cuda}"
  [ -n "${SMALL:-}" ] && QWEN="--layers 8 --heads 8 --head-dim 128 --page-size 16 --tokens 512 --chunks 1 --device ${DEV:-cuda}"
  export TE_RING_BYTES=${TE_RING_BYTES:-4294967296}
  # default: 4 runs of at most 100 s; the staged completion A/B is a second call:
  #   RUNS="staged:1:8:completion staged:8:16:completion" tools/gpu_e2e.sh percall
  for a in ${RUNS:-direct:1:8:completion direct:8:16:completion staged:1:8:grant staged:8:16:grant}; do
    IFS=: read -r path conc rooms ab <<<"$a"
    timeout ${T:-100} python3 tools/bench_transfer.py $QWEN --trace --path $path --concurrency $conc --rooms $rooms \
      --rounds 4 --lat-rooms 40 --ab $ab --json 2>&1 | grep -v "NIXL INFO" | tee "$OUT/percall-$path-c$conc-$ab.txt" \
      | grep -E "^path=|--ab|post_write|granted|StagingGrant|gathered|posted|notif|Scattered|d.waited|Error|Traceback"
  done
  exit 0
fi
if [ "$phase" = goalrows ]; then  # issues 40 and 41: every goal row of theirs on ONE H200, from one call (< 9.5 min)
  # 1. pagetables rows (1.07 GB rooms, each with its raw NIXL ceiling and its small rooms' p50/p99):
  #    41's first (direct contiguous c1: the small room direct; staged and P=1->D=2 small rooms), then
  #    40's (auto over realistic and scattered pages, page sizes 16 and 1, c8 and c1; direct contiguous c8)
  #    then the copy alone (bench_copy) and where its host call goes
  # 2. small rooms' step traces (one-page rooms, 1 in flight): direct over per-tensor pools (128
  #    descriptors), direct over a page-major pool (1 descriptor), the kernel path
  # 3. capacity: one-page rooms at 32 in flight
  # 4. the vLLM core's tail under auto (1K/4K/16K), the layer-wise tail and the engine's CPU over a forward
  # (RERUN: CUDA tests to run first.) Lines in $OUT/goalrows.txt, logs as $OUT/gr-*.log and $OUT/pt-*.log.
  # GR_SKIP="copy trace channels tails" skips parts; GR_BUDGET (540 s) bounds the tails.
  start=$SECONDS
  say() { echo "$*" | tee -a "$OUT/goalrows.txt"; }
  : >"$OUT/goalrows.txt"
  skip() { [[ " ${GR_SKIP:-} " == *" $1 "* ]]; }
  # (GR_ARGS replaces the sizes and device, passed on as PT_ARGS: a dry run on CPU with GR_SKIP=tails)
  QWEN=${GR_ARGS:-"--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"}
  export TE_RING_BYTES=${TE_RING_BYTES:-4294967296}
  if [ -n "${RERUN:-}" ]; then  # 0. the CUDA tests named in RERUN first (node ids or files; pytest arguments)
    # shellcheck disable=SC2086
    TE_TEST_DEVICE=cuda timeout ${RERUN_LIMIT:-90} python3 -m pytest -q -p no:cacheprovider -rfE $RERUN >"$OUT/gr-rerun.log" 2>&1
    say "rerun: rc $?, $(grep -v "NIXL INFO" "$OUT/gr-rerun.log" | grep -E '[0-9]+ (passed|failed)' | tail -1), $((SECONDS - start)) s"
    grep -E "^(FAILED|ERROR) " "$OUT/gr-rerun.log" | cut -c1-200 | head -12 | tee -a "$OUT/goalrows.txt"
  fi
  OUT=$OUT PT_ARGS=$QWEN BUDGET=${PT_BUDGET:-230} PT_LAYERWISE=none PT_ROWS=${PT_ROWS:-"direct-contiguous-c1 staged-realistic-c1
    p1d2-staged-realistic-c1 auto-realistic-c8 auto-realistic-c1 auto-scattered-c8 auto-realistic-c8-page1
    auto-scattered-c8-page1 direct-contiguous-c8"} bash "$0" pagetables 2>&1 \
    | grep -v "NIXL INFO" | grep -E "^\||^pagetables" | tee -a "$OUT/goalrows.txt"
  if ! skip copy; then  # the copy alone against a device copy, and where its host call goes (cProfile)
    timeout 40 python3 tools/bench_copy.py --page-size 16 --reps 5 --configs default --host-profile 300 \
      >"$OUT/gr-copy.log" 2>&1
    say "bench_copy, page 16, host call profiled: rc $?, $((SECONDS - start)) s"
    grep -v "NIXL INFO" "$OUT/gr-copy.log" | grep -v '^{' | tee -a "$OUT/goalrows.txt"
  fi
  if ! skip trace; then
    # (path:pool layout:local_notices) the kernel path twice: its notice by datagram, then over ZMQ
    for run in direct:tensors:1 direct:page-major:1 kernel:tensors:1 kernel:tensors:0; do
      IFS=: read -r path layout notices <<<"$run"
      log="$OUT/gr-trace-$path-$layout-$notices.log"
      TE_LOCAL_NOTICES=$notices timeout 40 python3 tools/bench_transfer.py $QWEN --tokens 16 --path "$path" \
        --pool-layout "$layout" --concurrency 1 --rooms 8 --rounds 1 --lat-rooms 60 --trace >"$log" 2>&1
      say "small room trace, $path, $layout pool, local_notices=$notices: rc $?, $((SECONDS - start)) s"
      grep -v "NIXL INFO" "$log" | grep -E "^path=" | cut -c1-700 | tee -a "$OUT/goalrows.txt"
      grep -v "NIXL INFO" "$log" | grep -E "CPU per room" | tee -a "$OUT/goalrows.txt"
      grep -v "NIXL INFO" "$log" | grep -A24 "steps of the small rooms" | tee -a "$OUT/goalrows.txt"
    done
  fi
  if ! skip channels; then  # one-way latency of a small message between two processes, by channel
    timeout 40 python3 tools/bench_channels.py --n 200 >"$OUT/gr-channels.log" 2>&1
    say "bench_channels: rc $?, $((SECONDS - start)) s"
    grep -v "NIXL INFO" "$OUT/gr-channels.log" | tee -a "$OUT/goalrows.txt"
  fi
  timeout 45 python3 tools/bench_transfer.py $QWEN --tokens 16 --concurrency 32 --rooms 1000 --rounds 1 --lat-rooms 50 \
    >"$OUT/gr-capacity.log" 2>&1
  say "capacity (one-page rooms, 32 in flight, auto): rc $?, $((SECONDS - start)) s"
  grep -E "^path=|CPU per room" "$OUT/gr-capacity.log" | cut -c1-700 | tee -a "$OUT/goalrows.txt"
  if ! skip tails; then
    left=$((${GR_BUDGET:-540} - (SECONDS - start)))
    timeout $((left < 110 ? (left > 20 ? left : 20) : 110)) python3 tools/bench_vllm_core.py --tokens 1024,4096,16384 \
      --reps ${VREPS:-3} --path auto --integrity off >"$OUT/gr-vllm.log" 2>&1
    say "vllm core tail, --path auto: rc $?, $((SECONDS - start)) s"
    grep -v "NIXL INFO" "$OUT/gr-vllm.log" | grep -E "^tokens=" | sed -E 's/ prefill=.*reported loaded:/:/' | cut -c1-220 \
      | tee -a "$OUT/goalrows.txt"
    left=$((${GR_BUDGET:-540} - (SECONDS - start)))
    timeout $((left < 80 ? (left > 20 ? left : 20) : 80)) python3 tools/bench_layerwise.py --device cuda --tokens 1024,16384 \
      --path auto --page-table realistic --per-write 4 --reps 3 --room-timeout 20 >"$OUT/gr-layerwise.log" 2>&1
    say "bench_layerwise auto realistic x4: rc $?, $((SECONDS - start)) s"
    grep -v "NIXL INFO" "$OUT/gr-layerwise.log" | tail -10 | tee -a "$OUT/goalrows.txt"
  fi
  say "goalrows: $((SECONDS - start)) s"
  exit 0
fi
if [ "$phase" = kernelrows ]; then  # the goal rows the kernel path moves, ONE H200, one call (< 9 min)
  # 1. the copy kernel alone at its default launch shape and two others (bench_copy, 32 KiB entries)
  # 2. pagetables rows: auto (the kernel path on one host) over realistic and scattered pages, c8 and c1,
  #    page sizes 16 and 1; direct contiguous c1 and c8 (NIXL) beside them
  # 3. the vLLM core's tail under auto, 64 layers in groups of 4, 1K/4K/16K tokens; the layer-wise tail
  # 4. small rooms: capacity at 32 in flight, and the kernel path's small room with integrity on/off (--trace)
  # (KR_TAILS=0 skips 3; RERUN names CUDA tests to run first; IV_ROWS adds integrity's A/B rows; PROFILE=prefill
  #  |decode|none: a c8 room under cProfile)
  # Lines in $OUT/kernelrows.txt, logs as $OUT/kr-*.log.
  start=$SECONDS
  say() { echo "$*" | tee -a "$OUT/kernelrows.txt"; }
  : >"$OUT/kernelrows.txt"
  QWEN="--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"
  export TE_RING_BYTES=${TE_RING_BYTES:-4294967296}
  if [ -n "${RERUN:-}" ]; then  # 0. the CUDA tests named in RERUN first (node ids or files)
    # shellcheck disable=SC2086
    TE_TEST_DEVICE=cuda timeout ${RERUN_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -rfE $RERUN >"$OUT/kr-rerun.log" 2>&1
    say "rerun: rc $?, $(grep -v "NIXL INFO" "$OUT/kr-rerun.log" | grep -E '[0-9]+ (passed|failed)' | tail -1), $((SECONDS - start)) s"
    grep -E "^(FAILED|ERROR) " "$OUT/kr-rerun.log" | cut -c1-200 | head -12 | tee -a "$OUT/kernelrows.txt"
  fi
  timeout 40 python3 tools/bench_copy.py --page-size 16 --reps 15 --configs ${COPY_CONFIGS:-default} >"$OUT/kr-copy.log" 2>&1
  say "bench_copy: rc $?"; grep -v "NIXL INFO" "$OUT/kr-copy.log" | grep -v '^{' | tee -a "$OUT/kernelrows.txt"
  OUT=$OUT BUDGET=${PT_BUDGET:-240} PT_LAYERWISE=none PT_ROWS=${PT_ROWS:-"auto-realistic-c8 auto-realistic-c1 auto-scattered-c8 auto-scattered-c1
    auto-realistic-c8-page1 auto-realistic-c1-page1 direct-contiguous-c1 direct-contiguous-c8"} bash "$0" pagetables 2>&1 \
    | grep -v "NIXL INFO" | grep -E "^\|" | tee -a "$OUT/kernelrows.txt"
  [ "${KR_TAILS:-1}" = 1 ] && timeout 100 python3 tools/bench_vllm_core.py --tokens 1024,4096,16384 --reps ${VREPS:-3} --path auto --integrity off \
    >"$OUT/kr-vllm.log" 2>&1
  say "vllm core tail, --path auto (the copy kernel): rc $?"
  grep -v "NIXL INFO" "$OUT/kr-vllm.log" | grep -E "^tokens=" | sed -E 's/ prefill=.*reported loaded:/:/' | cut -c1-220 \
    | tee -a "$OUT/kernelrows.txt"
  [ "${KR_TAILS:-1}" = 1 ] && timeout 70 python3 tools/bench_layerwise.py --device cuda --tokens 1024,16384 --path auto --page-table realistic \
    --per-write 1,4 --reps 3 --room-timeout 20 >"$OUT/kr-layerwise.log" 2>&1
  say "bench_layerwise auto realistic: rc $?"; grep -v "NIXL INFO" "$OUT/kr-layerwise.log" | tail -8 | tee -a "$OUT/kernelrows.txt"
  timeout 45 python3 tools/bench_transfer.py $QWEN --tokens 16 --concurrency 32 --rooms 1000 --rounds 1 --lat-rooms 50 \
    >"$OUT/kr-capacity.log" 2>&1
  say "capacity (one-page rooms, 32 in flight, auto): rc $?"; grep -E "^path=" "$OUT/kr-capacity.log" | cut -c1-600 | tee -a "$OUT/kernelrows.txt"
  timeout 45 python3 tools/bench_transfer.py $QWEN --tokens 16 --path kernel --rooms 8 --rounds 2 --lat-rooms 60 \
    --ab integrity --trace >"$OUT/kr-small.log" 2>&1
  say "kernel path small room, integrity A/B, trace: rc $?"
  grep -v "NIXL INFO" "$OUT/kr-small.log" | grep -vE "^\s*$" | grep -B1 -A28 "^path=" | cut -c1-400 | tee -a "$OUT/kernelrows.txt"
  if [ -n "${IV_ROWS:-}" ]; then  # integrity's A/B on 1.07 GB rooms (e.g. IV_ROWS="kernel:8"), no vLLM core sweep
    OUT=$OUT BUDGET=${IV_BUDGET:-100} IV_ROWS=$IV_ROWS bash "$0" integrity 2>&1 | grep -v "NIXL INFO" \
      | grep -E "^[a-z]+-c[0-9]+:" | tee -a "$OUT/kernelrows.txt"
  fi
  if [ "${PROFILE:-prefill}" != none ]; then  # where a side's loop goes per 1.07 GB room at c8 (cProfile)
    timeout 60 python3 tools/bench_transfer.py $QWEN --path auto --page-table realistic --concurrency 8 --rooms 48 \
      --rounds 1 --lat-rooms 4 --profile ${PROFILE:-prefill} >"$OUT/kr-profile.log" 2>&1
    say "auto realistic c8 under cProfile (${PROFILE:-prefill}): rc $?"
    grep -v "NIXL INFO" "$OUT/kr-profile.log" | grep -A31 "top 30 by own time" | cut -c1-160 | tee -a "$OUT/kernelrows.txt"
    grep -E "CPU per room" "$OUT/kr-profile.log" | tee -a "$OUT/kernelrows.txt"
  fi
  say "kernelrows: $((SECONDS - start)) s"
  exit 0
fi
if [ "$phase" = copycheck ]; then  # the copy kernel and integrity on the kernel path, ONE GPU, one call (< 7 min)
  # 1. the CUDA tests named in RERUN (node ids or files; the failures of the last cuda phase and the new ones)
  # 2. tools/bench_copy.py: the copy kernel alone against a plain device copy of the room's bytes, per launch
  #    shape (COPY_CONFIGS), Qwen3-32B-shaped rooms of 32 KiB entries (page 16) and 2 KiB entries (page 1)
  # 3. the integrity phase's A/B rows on the kernel path (IV_ROWS, default kernel:1 kernel:8) and the vLLM
  #    core's false failures with integrity on under auto (the kernel path on one host)
  # Lines in $OUT/copycheck.txt, logs as $OUT/cc-*.log.
  start=$SECONDS
  say() { echo "$*" | tee -a "$OUT/copycheck.txt"; }
  : >"$OUT/copycheck.txt"
  if [ -n "${RERUN:-}" ]; then
    # shellcheck disable=SC2086
    TE_TEST_DEVICE=cuda timeout ${RERUN_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rfE $RERUN >"$OUT/cc-rerun.log" 2>&1
    say "rerun: rc $?, $(grep -v "NIXL INFO" "$OUT/cc-rerun.log" | grep -E '[0-9]+ (passed|failed)' | tail -1), $((SECONDS - start)) s"
    grep -E "^(FAILED|ERROR) " "$OUT/cc-rerun.log" | cut -c1-200 | head -12 | tee -a "$OUT/copycheck.txt"
  fi
  for ps in 16 1; do
    timeout 45 python3 tools/bench_copy.py --page-size $ps --reps 15 \
      --configs "${COPY_CONFIGS:-32768:4,65536:4,65536:8,131072:4,131072:8,262144:8,16384:4,8192:2,16384:2}" \
      >"$OUT/cc-copy-$ps.log" 2>&1
    say "bench_copy page size $ps: rc $?"
    grep -v "NIXL INFO" "$OUT/cc-copy-$ps.log" | grep -v '^{' | tee -a "$OUT/copycheck.txt"
  done
  OUT=$OUT BUDGET=${IV_BUDGET:-330} IV_ROWS=${IV_ROWS:-"kernel:1 kernel:8"} bash "$0" integrity 2>&1 | grep -v "NIXL INFO" \
    | tail -14 | tee -a "$OUT/copycheck.txt"
  say "copycheck: $((SECONDS - start)) s, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  exit 0
fi
if [ "$phase" = kernelpath ]; then  # issue 40 item 2, one call (< 3 min; BUDGET s, default 170)
  # 1. every CUDA test of the kernel path: the copy kernel (gpu-marked), CUDA IPC between two processes
  #    (bytes, kills), the in-process protocol on CUDA pools; counts and failing node ids.
  # 2. bench_transfer --path kernel against raw NIXL of the same run (Qwen3-32B-shaped 1.07 GB rooms,
  #    realistic page tables, 1 and 8 in flight; page size 1 at 8 in flight), one line each.
  # 3. the layer-wise tail with auto (which takes the kernel path on one host), 1K and 16K tokens.
  # Logs in $OUT/kp-*.log, summary in $OUT/kernelpath.txt. (KP_ARGS / KP_LAYERWISE / KP_TESTS replace
  # the sizes, device and test selection: a dry run on CPU with small rooms.)
  start=$SECONDS
  budget=${BUDGET:-170}
  : >"$OUT/kernelpath.txt"
  left() { echo $((budget - (SECONDS - start))); }
  KP_TESTS=${KP_TESTS:-"-m gpu tests/kernels/test_copy.py tests/gpu/test_kernel_path_gpu.py tests/integration/test_kernel_path.py"}
  t0=$SECONDS
  # shellcheck disable=SC2086
  TE_TEST_DEVICE=${KP_DEVICE:-cuda} timeout 75 python3 -m pytest -q -p no:cacheprovider -rfE $KP_TESTS >"$OUT/kp-tests.log" 2>&1
  rc=$?
  counts=$(grep -v "NIXL INFO" "$OUT/kp-tests.log" | grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)" | tail -1)
  echo "tests: rc $rc, ${counts:-no summary (see kp-tests.log)}, $((SECONDS - t0)) s" | tee -a "$OUT/kernelpath.txt"
  grep -E "^(FAILED|ERROR) " "$OUT/kp-tests.log" | cut -c1-200 | head -15 | tee -a "$OUT/kernelpath.txt"
  QWEN=${KP_ARGS:-"--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"}
  for row in "1 16 6" "8 16 16" "8 1 16"; do  # concurrency, page size, rooms
    set -- $row
    [ "$(left)" -lt 25 ] && { echo "bench c$1 page $2: skipped, the phase's $budget s were spent" | tee -a "$OUT/kernelpath.txt"; continue; }
    lim=$(left); [ "$lim" -gt 45 ] && lim=45
    # shellcheck disable=SC2086
    timeout "$lim" python3 tools/bench_transfer.py $QWEN --page-size "$2" --path kernel --page-table realistic \
      --concurrency "$1" --rooms "$3" --rounds 2 --lat-rooms 10 --json >"$OUT/kp-bench-c$1-p$2.log" 2>&1
    echo "bench kernel c$1 page $2: rc $?" | tee -a "$OUT/kernelpath.txt"
    grep -v "NIXL INFO" "$OUT/kp-bench-c$1-p$2.log" | grep -E "^path=|Error|Traceback" | cut -c1-400 | tee -a "$OUT/kernelpath.txt"
  done
  if [ "$(left)" -gt 30 ]; then
    lim=$(left); [ "$lim" -gt 60 ] && lim=60
    # shellcheck disable=SC2086
    timeout "$lim" python3 tools/bench_layerwise.py ${KP_LAYERWISE:-"--device cuda --tokens 1024,16384"} --path auto \
      --page-table realistic --per-write 1 --reps 3 --room-timeout 20 >"$OUT/kp-layerwise.log" 2>&1
    echo "bench_layerwise auto (kernel on one host): rc $?" | tee -a "$OUT/kernelpath.txt"
    grep -v "NIXL INFO" "$OUT/kp-layerwise.log" | tail -8 | tee -a "$OUT/kernelpath.txt"
  else
    echo "bench_layerwise: skipped, the phase's $budget s were spent" | tee -a "$OUT/kernelpath.txt"
  fi
  echo "kernelpath: $((SECONDS - start)) s, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee -a "$OUT/kernelpath.txt"
  exit 0
fi
if [ "$phase" = onegpu ] || [ "$phase" = onegpu2 ]; then  # the goal rows of the data-path, control-path,
  # integrity and link issues on ONE H200 (prefill and decode processes share cuda:0), in two calls of < 9.5 min:
  #   onegpu:  RERUN's node ids on CUDA (if set), the vLLM core's tail (auto -> the copy kernel on one host,
  #            and direct: NIXL from the descriptor tables), then the pagetables rows until BUDGET s
  #   onegpu2: integrity A/B and false failures (the integrity phase), the small-room capacity, the staged
  #            small room's trace and tail, page size 1 rows, the block-major vLLM layout against LBNHC
  # One line per row in $OUT/onegpu.txt; logs as $OUT/og-*.log.
  start=$SECONDS
  say() { echo "$*" | tee -a "$OUT/onegpu.txt"; }
  QWEN="--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"
  export TE_RING_BYTES=${TE_RING_BYTES:-4294967296}
  if [ "$phase" = onegpu ]; then
    if [ -n "${RERUN:-}" ]; then
      TE_TEST_DEVICE=cuda timeout ${RERUN_LIMIT:-110} python3 -m pytest -q -p no:cacheprovider -rfE $RERUN >"$OUT/og-rerun.log" 2>&1
      say "rerun: rc $?, $(grep -E '[0-9]+ (passed|failed)' "$OUT/og-rerun.log" | tail -1)"
      grep -E "^(FAILED|ERROR) " "$OUT/og-rerun.log" | cut -c1-200 | head -12 | tee -a "$OUT/onegpu.txt"
    fi
    OUT=$OUT BUDGET=${PT_BUDGET:-170} bash "$0" pagetables 2>&1 | grep -v "NIXL INFO" | grep -E "^\|" \
      | tee -a "$OUT/onegpu.txt"
    for v in "auto 33554432" "direct 33554432" "direct 1"; do  # the kernel; NIXL from tables; NIXL, per-WRITE lists
      set -- $v
      timeout 100 python3 tools/bench_vllm_core.py --tokens 1024,4096,16384 --reps ${VREPS:-3} --path $1 --integrity off \
        --table-max-descriptors $2 >"$OUT/og-vllm-$1-$2.log" 2>&1
      say "vllm core tail, --path $1 --table-max-descriptors $2: rc $?"
      grep -v "NIXL INFO" "$OUT/og-vllm-$1-$2.log" | grep -E "^tokens=" | sed -E 's/ prefill=.*reported loaded:/:/' \
        | cut -c1-200 | tee -a "$OUT/onegpu.txt"
    done
  else
    go() { [ $((SECONDS - start)) -lt ${STOP:-490} ] && return 0; say "$1: skipped, past ${STOP:-490} s"; return 1; }
    for cap in ${TABLES_AB-33554432 1}; do  # descriptor tables A/B, direct realistic c8 (TABLES_AB= skips it)
      TE_TABLE_MAX_DESCRIPTORS=$cap timeout 70 python3 tools/bench_transfer.py $QWEN --path direct --page-table realistic \
        --concurrency 8 --rooms 16 --rounds 2 --lat-rooms 16 >"$OUT/og-tables-$cap.log" 2>&1
      say "direct realistic c8, TE_TABLE_MAX_DESCRIPTORS=$cap: rc $?"
      grep -E "^path=" "$OUT/og-tables-$cap.log" | cut -c1-700 | tee -a "$OUT/onegpu.txt"
    done
    OUT=$OUT BUDGET=${IV_BUDGET:-170} bash "$0" integrity 2>&1 | grep -v "NIXL INFO" | tail -14 | tee -a "$OUT/onegpu.txt"
    if go capacity; then
      timeout 60 python3 tools/bench_transfer.py $QWEN --tokens 16 --concurrency 32 --rooms 2000 --rounds 1 \
        --lat-rooms 50 >"$OUT/og-capacity.log" 2>&1
      say "capacity (one-page rooms, 32 in flight): rc $?"
      grep -E "^path=" "$OUT/og-capacity.log" | cut -c1-600 | tee -a "$OUT/onegpu.txt"
    fi
    if go staged; then
      timeout 75 python3 tools/bench_transfer.py $QWEN --path staged --concurrency 8 --rooms 16 --rounds 2 \
        --lat-rooms 100 --trace >"$OUT/og-staged.log" 2>&1
      say "staged c8 and its small rooms: rc $?"
      grep -v "NIXL INFO" "$OUT/og-staged.log" | grep -vE "^\s*$" | tail -30 | cut -c1-400 | tee -a "$OUT/onegpu.txt"
    fi
    if go page-size-1; then
      timeout 70 python3 tools/bench_transfer.py ${QWEN/--page-size 16/--page-size 1} --path auto --page-table realistic \
        --concurrency 8 --rooms 16 --rounds 2 --lat-rooms 8 >"$OUT/og-ps1.log" 2>&1
      say "page size 1, auto, realistic, c8: rc $?"
      grep -E "^path=" "$OUT/og-ps1.log" | cut -c1-600 | tee -a "$OUT/onegpu.txt"
    fi
    if go page-major; then
      timeout 50 python3 tools/bench_transfer.py $QWEN --path direct --page-table contiguous --concurrency 1 --rooms 4 \
        --rounds 2 --lat-rooms 30 --pool-layout page-major >"$OUT/og-pagemajor.log" 2>&1
      say "direct contiguous c1, page-major pools: rc $?"
      grep -E "^path=" "$OUT/og-pagemajor.log" | cut -c1-700 | tee -a "$OUT/onegpu.txt"
    fi
    if go block-major; then
      timeout 70 python3 tools/bench_vllm_core.py --tokens 1024,16384 --reps 3 --layouts LBNHC,BLNHC --path direct \
        --integrity off >"$OUT/og-vllm-blockmajor.log" 2>&1
      say "vllm core tail, LBNHC vs BLNHC, NIXL tables: rc $?"
      grep -v "NIXL INFO" "$OUT/og-vllm-blockmajor.log" | grep -E "^tokens=" | sed -E 's/ prefill=.*reported loaded:/:/' \
        | cut -c1-200 | tee -a "$OUT/onegpu.txt"
    fi
  fi
  say "$phase: $((SECONDS - start)) s"
  exit 0
fi
if [ "$phase" = cuda ]; then  # every CUDA-only test CI cannot run, in one call (< 8 min), most telling first:
  # the gpu-marked kernel and unit tests (integrity's ordering among them), the integration suites on
  # CUDA pools (integrity, its order and the busy-decode race first), the chaos integrity tests on
  # CUDA pools (a bit flipped in flight), the vLLM core on CUDA caches (every layout with integrity
  # on at 1K/4K/16K tokens, a flipped bit), the other integration suites, then the vLLM core bench
  # with integrity on (false INTEGRITY failures counted per length).
  # One line per step: its counts and seconds, then its failing node ids; logs in $OUT/cuda-*.log.
  start=$SECONDS
  budget=${BUDGET:-450}
  step() {  # step NAME LIMIT_S CMD...: run one pytest command under a limit, print counts and failures
    local name=$1 limit=$2
    shift 2
    # CUDA_STEPS="kernels integration bench": only these steps; LIMIT_<step>=S: that step's limit
    [ -n "${CUDA_STEPS:-}" ] && [[ " $CUDA_STEPS " != *" $name "* ]] && return
    local over="LIMIT_${name//-/_}"
    [ -n "${!over:-}" ] && limit=${!over}
    local left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
      echo "$name: skipped, the phase's $budget s were spent" | tee -a "$OUT/cuda.txt"
      return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/cuda-$name.log" 2>&1
    local rc=$?
    local counts
    counts=$(grep -v "NIXL INFO" "$OUT/cuda-$name.log" | grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)" | tail -1)
    echo "$name: rc $rc, ${counts:-no summary (see cuda-$name.log)}, $((SECONDS - t0)) s" | tee -a "$OUT/cuda.txt"
    grep -E "^(FAILED|ERROR) " "$OUT/cuda-$name.log" | cut -c1-200 | head -15 | tee -a "$OUT/cuda.txt"
  }
  : >"$OUT/cuda.txt"
  PYT="python3 -m pytest -q -p no:cacheprovider -rfE"
  step kernels 170 $PYT -m gpu tests/kernels tests/unit
  step integrity 150 env TE_TEST_DEVICE=cuda $PYT tests/integration/test_integrity_race.py \
    tests/integration/test_integrity_order.py tests/integration/test_integrity.py
  step chaos-integrity 90 env TE_TEST_DEVICE=cuda $PYT tests/chaos/test_integrity.py
  step vllm-gpu 300 env TE_TEST_DEVICE=cuda $PYT tests/gpu/test_vllm_gpu.py tests/gpu/test_link_gpu.py
  step kernel-path 120 env TE_TEST_DEVICE=cuda $PYT tests/gpu/test_kernel_path_gpu.py \
    tests/integration/test_kernel_path.py
  step tables 100 env TE_TEST_DEVICE=cuda $PYT tests/integration/test_tables.py tests/integration/test_link_handshake.py \
    tests/integration/test_ready_events.py
  step integration 150 env TE_TEST_DEVICE=cuda $PYT tests/integration/test_matrix.py \
    tests/integration/test_staged.py tests/integration/test_failures.py tests/integration/test_matrix_strided.py \
    tests/integration/test_scattered_pages.py tests/integration/test_smoke.py
  left=$((budget - (SECONDS - start)))
  if [ -n "${CUDA_STEPS:-}" ] && [[ " $CUDA_STEPS " != *" bench "* ]]; then
    echo "bench_vllm_core --integrity on: not in CUDA_STEPS" | tee -a "$OUT/cuda.txt"
  elif [ "$left" -gt 40 ]; then  # the vLLM core with integrity on, 1K/4K/16K tokens (the issue's race)
    timeout $((left < 120 ? left : 120)) python3 tools/bench_vllm_core.py --integrity on --tokens 1024,4096,16384 \
      --reps ${REPS:-3} >"$OUT/cuda-bench-vllm.log" 2>&1
    echo "bench_vllm_core --integrity on: rc $?" | tee -a "$OUT/cuda.txt"
    grep -v "NIXL INFO" "$OUT/cuda-bench-vllm.log" | grep -iE "INTEGRITY:|error|Traceback" | cut -c1-200 \
      | sort | uniq -c | head -8 | tee -a "$OUT/cuda.txt"
    grep -E "^integrity=" "$OUT/cuda-bench-vllm.log" | tee -a "$OUT/cuda.txt"
  else
    echo "bench_vllm_core --integrity on: skipped, the phase's $budget s were spent" | tee -a "$OUT/cuda.txt"
  fi
  echo "cuda: $((SECONDS - start)) s, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee -a "$OUT/cuda.txt"
  exit 0
fi
if [ "$phase" = integrity ]; then  # integrity's cost and false failures on ONE GPU (both processes on cuda:0), < 4 min
  # 1. The A/B rows of issue 42's goals: Qwen3-32B-shaped 1.07 GB rooms (one chunk each, contiguous
  #    page tables), direct 1 and 8 in flight, staged 8 in flight, each ONE bench_transfer run with
  #    --ab integrity (even rounds and small-room samples with the checksums on, odd ones off, in the
  #    same processes, each round against the raw NIXL ceiling taken just before it). One line per
  #    row: ratio to raw on / off, the cost (1 - on/off), the small room's added time on / off, the
  #    decode's checks (a mismatch or failed_integrity there is a false failure) and wrong bytes.
  # 2. The vLLM core with integrity on over every layout (tests/gpu/vllm_kv.py caches, vLLM 0.32's),
  #    1K/4K/16K tokens x (REPS + 1 warm-up) requests: every request counted, one summary line.
  # Lines in $OUT/integrity.txt, the runs' JSON in $OUT/integrity.jsonl, logs as $OUT/iv-*.log.
  # (IV_ARGS / IV_CORE_ARGS replace the sizes and device: a dry run on CPU with small rooms;
  #  IV_ROWS picks rows, IV_LAYERS the vLLM core's layers: 16 by default, 64 is Qwen3-32B's.)
  QWEN=${IV_ARGS:-"--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"}
  QWEN="$QWEN --json --page-table contiguous --ab integrity"
  export TE_RING_BYTES=${TE_RING_BYTES:-4294967296}
  start=$SECONDS
  budget=${BUDGET:-230}
  : >"$OUT/integrity.txt"
  for row in ${IV_ROWS:-direct:1 direct:8 staged:8}; do
    IFS=: read -r path conc <<<"$row"
    name=$path-c$conc
    if [ $((budget - (SECONDS - start))) -lt 60 ]; then
      echo "$name: skipped, the phase's $budget s were spent" | tee -a "$OUT/integrity.txt"
      continue
    fi
    runs="--concurrency $conc --rooms $((conc == 1 ? 16 : conc * 16)) --rounds 8 --lat-rooms 60"
    t0=$SECONDS
    timeout ${IV_ROW_S:-75} python3 tools/bench_transfer.py $QWEN --path $path $runs >"$OUT/iv-$name.log" 2>&1
    rc=$?
    grep -o '{"room_bytes".*' "$OUT/iv-$name.log" >>"$OUT/integrity.jsonl"
    python3 - "$name" "$rc" "$OUT/iv-$name.log" "$((SECONDS - t0))" <<'EOF' | tee -a "$OUT/integrity.txt"
import json, sys
name, rc, log, took = sys.argv[1:]
lines = [line[line.index('{"room_bytes"'):] for line in open(log) if '{"room_bytes"' in line]
if not lines:
    tail = [line.strip() for line in open(log) if "NIXL INFO" not in line][-3:]
    print(f"{name}: failed, rc {rc}: {' / '.join(tail)}")
    sys.exit(0)
r = json.loads(lines[-1])
on, off = r["ab"]["on"], r["ab"]["off"]
cost = f"{(1 - on['ratio'] / off['ratio']) * 100:.1f}%" if on["ratio"] and off["ratio"] else "-"
added = (
    f"{on['added_ms']:.3f} / {off['added_ms']:.3f} ms ({on['added_ms'] - off['added_ms']:+.3f})"
    if on["added_ms"] is not None and off["added_ms"] is not None
    else "-"
)
c = r.get("integrity_counters", {})
print(
    f"{name}: ratio on {on['ratio']} / off {off['ratio']}, cost {cost}; small room added on / off {added};"
    f" checks match {c.get('integrity_match')} mismatch {c.get('integrity_mismatch')} unchecked"
    f" {c.get('integrity_unchecked')} failed_integrity {c.get('failed_integrity')}; wrong bytes {r['mismatches']}"
    f" | path {r['engine_path']}, rooms {r['room_bytes'] / 1e6:.0f} MB, raw {r['raw_gbps']:.0f} GB/s, rounds"
    f" {on['rounds']} / {off['rounds']}; rc {rc}, {took} s"
)
EOF
  done
  left=$((budget - (SECONDS - start)))
  if [ "$left" -gt 40 ]; then
    timeout $((left + 20)) python3 tools/bench_vllm_core.py --integrity on --layouts all --tokens 1024,4096,16384 \
      --reps ${REPS:-10} --layers ${IV_LAYERS:-16} --budget $((left - 30)) ${IV_CORE_ARGS:-} >"$OUT/iv-vllm-core.log" 2>&1
    rc=$?
    grep -v "NIXL INFO" "$OUT/iv-vllm-core.log" | grep -E "^tokens=" | sed -E 's/ prefill=.*decode reported loaded: / tail /' \
      | cut -c1-260 | tee -a "$OUT/integrity.txt"
    grep -v "NIXL INFO" "$OUT/iv-vllm-core.log" | grep -iE "INTEGRITY:|skipped|Traceback|Error" | cut -c1-200 \
      | sort | uniq -c | head -8 | tee -a "$OUT/integrity.txt"
    echo "vllm core, every layout: rc $rc; $(grep -E '^integrity=' "$OUT/iv-vllm-core.log" || echo 'no summary (see iv-vllm-core.log)')" \
      | tee -a "$OUT/integrity.txt"
  else
    echo "vllm core, every layout: skipped, the phase's $budget s were spent" | tee -a "$OUT/integrity.txt"
  fi
  echo "integrity: $((SECONDS - start)) s, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee -a "$OUT/integrity.txt"
  exit 0
fi
if [ "$phase" = tests ]; then
  python3 -m pytest -q -p no:cacheprovider tests/unit tests/kernels 2>&1 | tail -5 | tee -a "$OUT/tests.txt"
  TE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/integration/test_matrix.py \
    tests/integration/test_staged.py tests/integration/test_failures.py 2>&1 | tail -8 | tee -a "$OUT/tests.txt"
  exit 0
fi

# Qwen3-32B-shaped KV: 64 layers, 8 KV heads, head_dim 128, bf16; rooms of one 4096-token chunk.
QWEN="--layers 64 --heads 8 --head-dim 128 --page-size 16 --tokens 4096 --chunks 1 --device cuda"
run() {  # run NAME ARGS...: one benchmark, its JSON line appended to $OUT/bench.jsonl
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/bench.txt"
  timeout 300 python3 tools/bench_transfer.py $QWEN --json "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep '^{' "$OUT/$name.log" >>"$OUT/bench.jsonl"
  grep '^path=' "$OUT/$name.log" | tee -a "$OUT/bench.txt"
  [ $rc -eq 0 ] || { echo "rc=$rc"; grep -v "NIXL INFO" "$OUT/$name.log" | tail -15; } | tee -a "$OUT/bench.txt"
}
for scenario in "$@"; do
  P=${scenario%:*}; D=${scenario#*:}
  tp="--prefill-tp $P --decode-tp $D"
  paths="staged host"
  [ "$P" = "$D" ] && paths="direct staged host"
  for path in ${PATHS:-$paths}; do
    for conc in ${CONCS:-1 8 32}; do
      [ "$path" = host ] && [ "$conc" != 8 ] && continue
      rooms=$(( (conc * 2 > 16 ? conc * 2 : 16) * 3 ))  # 3 rounds, each with its own raw ceiling
      run "p${P}d${D}-$path-c$conc" $tp --path "$path" --concurrency "$conc" --rooms "$rooms" --rounds 3 \
        --lat-rooms 20
    done
  done
  # the slice baseline: ~6 us per descriptor makes each room seconds long; two rooms suffice
  [ -n "${NOSLICE:-}" ] && continue
  run "p${P}d${D}-slice-c1" $tp --path slice --concurrency 1 --rooms 2 --rounds 1 --lat-rooms 5 --raw-reps 5 --warmup 0 \
    --heartbeat-interval 30
done
