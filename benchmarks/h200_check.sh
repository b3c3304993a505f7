#!/usr/bin/env bash
# One prepared run of every check that needs a GPU, on a lent H200 (the device tool; under 10 minutes with a cold
# compile cache, each step under its own timeout so one that hangs costs only its share):
#   1. benchmarks/gpu_checks.py: host syncs inside a step (torch.cuda.set_sync_debug_mode), two identical tiny runs
#      bitwise without and with train.deterministic, the fused-attention-only check of one gpt-modern-1b block in
#      fp32 and bf16, graphs and graph breaks of a compiled run (validation and the sample must add none);
#   2. GPT-3 1.3B (vocab 50304, as the planner's), micro-batch 8 x 2048, bf16, compiled blocks: hybridpar's step
#      against the plain loop in the same process (hybridpar's result is written before the baseline starts);
#   3. the same 1.3B as 4 x 2 microbatches, accumulating unsharded and sharded: peak memory against the planner;
#   4. GPT-3 6.7B, full activation checkpointing: speed, MFU, peak memory against the planner;
#   5. fp8 (torchao, carried as a wheel): the 1.3B of step 2 with train.fp8 tensorwise and rowwise (tokens/s against
#      step 2's bf16), and the convergence gate (benchmarks/fp8_gate.py: 300 steps of GPT-3 125M, bf16 against both
#      recipes from one seed checkpoint).
# Results go to $OUT (one JSON per check, log.txt, summary.txt); docs/performance.md takes the figures.
#
# SMOKE=1 runs the same steps on the CPU with the tiny models (no compile in steps 2-4): the test suite does, so
# the script is known to start before a GPU is lent (tests/test_gpu_check.py).
#
# Before calling it on the device (here, once): megatron-core travels as a wheel (the machine has torch, einops,
# pyyaml, tokenizers, safetensors, sentencepiece; wandb is not needed with --logging.wandb.mode disabled):
#   mkdir -p .git/info; echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0
# then run it with the device tool: command `bash benchmarks/h200_check.sh`, carry [".whl"], timeout_s 600.
set -uo pipefail
OUT=${OUT:-/tmp/hybridpar-h200}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt"; }
step() {  # step NAME TIMEOUT_S COMMAND...: output to $OUT/NAME.txt, a failure logged and the run goes on
  local name=$1 limit=$2; shift 2
  log "$name"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1 || log "$name: exit $?"
}

if [ "$SMOKE" = 1 ]; then
  CACHE=${HYBRIDPAR_CACHE:-$OUT/cache}
  TINY=(--model.name tiny --train.seq_len 64 --train.global_batch_size 4 --train.eval_batches 1
        --data.cache_dir "$CACHE")
  MODERN=(--model.name tiny --model.norm rmsnorm --model.position rope --model.mlp swiglu --model.n_kv_heads 2
          --model.bias false --model.tie_embeddings false --train.seq_len 128)
  BIG=(--model.name tiny --train.seq_len 64 --train.global_batch_size 8 --train.precision bf16)
  LARGE=("${BIG[@]}")
  COMPILE=false; STEPS=(--warmup 1 --steps 1); SHORT=(--warmup 0 --steps 1); LONG=120
  GATE=(--steps 3 -- --model.name tiny --train.seq_len 64 --train.global_batch_size 4 --train.precision bf16)
else
  if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { log "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # hybridpar itself (hybridpar.models lives in models/ through package_dir, so it must be installed)
  $PY -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/hp . || { log "install failed"; exit 1; }
  export PYTHONPATH=/tmp/hp:${PYTHONPATH:-}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
  CACHE=/tmp/hpcache
  TINY=(--model.name tiny --train.seq_len 128 --train.global_batch_size 8 --data.cache_dir "$CACHE")
  MODERN=(--model.name gpt-modern-1b --train.seq_len 2048)
  BIG=(--model.name gpt3-1.3b --model.vocab_size 50304 --train.seq_len 2048 --train.global_batch_size 8
       --train.precision bf16)
  LARGE=(--model.name gpt3-6.7b --model.vocab_size 50304 --train.seq_len 2048 --train.global_batch_size 8
         --train.precision bf16)
  COMPILE=true; STEPS=(--warmup 5 --steps 15); SHORT=(--warmup 2 --steps 3); LONG=180
  GATE=(--steps 300 -- --model.name gpt3-125m --train.seq_len 1024 --train.global_batch_size 16
        --train.precision bf16 --train.compile true)
fi
$PY -c "import torch, megatron.core.datasets; print('torch', torch.__version__, torch.cuda.is_available())" \
  2>&1 | tee -a "$OUT/log.txt"
COMMON=(--logging.wandb.mode disabled --data.cache_dir "$CACHE")

# 1. the small checks (tiny models: seconds each, plus a cold compile)
step syncs 60 $PY benchmarks/gpu_checks.py syncs --json "$OUT/syncs.json" "${TINY[@]}" --optim.fused true
step bitwise 60 $PY benchmarks/gpu_checks.py bitwise --json "$OUT/bitwise.json" "${TINY[@]}"
step bitwise_det 60 $PY benchmarks/gpu_checks.py bitwise --deterministic true --json "$OUT/bitwise_det.json" \
  "${TINY[@]}"
step attention 45 $PY benchmarks/gpu_checks.py attention --json "$OUT/attention.json" "${MODERN[@]}"
step compile 120 $PY benchmarks/gpu_checks.py compile --json "$OUT/compile.json" "${TINY[@]}"

# 2. 1.3B against the plain loop, one microbatch of 8
step bench_1.3b $LONG $PY launch/benchmark.py "${BIG[@]}" "${COMMON[@]}" --train.micro_batch_size 8 \
  --train.compile $COMPILE "${STEPS[@]}" --baseline plain --json "$OUT/bench_1.3b.json"
# 3. 1.3B in 4 x 2 microbatches, both ways of accumulating (eager: the planner's activations are eager's)
for mode in true false; do
  step "accum_$mode" 75 $PY launch/benchmark.py "${BIG[@]}" "${COMMON[@]}" --train.micro_batch_size 4 \
    --parallel.accumulate_unsharded $mode "${SHORT[@]}" --json "$OUT/accum_$mode.json"
done
# 4. 6.7B with full activation checkpointing
step bench_6.7b 100 $PY launch/benchmark.py "${LARGE[@]}" "${COMMON[@]}" --train.micro_batch_size 8 \
  --train.compile $COMPILE --train.activation_checkpointing full "${SHORT[@]}" --json "$OUT/bench_6.7b.json"

# 5. fp8: the 1.3B of step 2 in both recipes, and the convergence gate
for recipe in tensorwise rowwise; do
  step "fp8_$recipe" $LONG $PY launch/benchmark.py "${BIG[@]}" "${COMMON[@]}" --train.micro_batch_size 8 \
    --train.compile $COMPILE --train.fp8 $recipe "${STEPS[@]}" --json "$OUT/fp8_$recipe.json"
done
step fp8_gate 300 $PY benchmarks/fp8_gate.py --out "$OUT/gate" "${GATE[@]}" "${COMMON[@]}"
cp "$OUT/gate/fp8_gate.json" "$OUT/fp8_gate.json" 2>/dev/null

$PY - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt" | tee -a "$OUT/log.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def read(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError) as e:
        print(f"{name}: MISSING ({e.__class__.__name__})")
        return None
for name in ("syncs", "bitwise", "bitwise_det", "attention", "compile"):
    r = read(name)
    if r is not None:
        print(f"{name}: {'ok' if r['ok'] else 'FAILED'} " + json.dumps({k: v for k, v in r.items() if k not in
              ("check", "ok", "losses", "torch", "device_name")}))
for name in ("bench_1.3b", "accum_true", "accum_false", "bench_6.7b", "fp8_tensorwise", "fp8_rowwise"):
    b = read(name)
    if b is None:
        continue
    peak, planned = b["peak_mem_bytes"], b["planned_bytes"]
    mem = (f"peak {peak / 2**30:.1f} GiB (reserved {b['peak_reserved_bytes'] / 2**30:.1f}), planner "
           f"{planned / 2**30:.1f} GiB ({planned / peak - 1:+.1%})" if peak else f"planner {planned / 2**20:.1f} MiB")
    mfu = f", MFU {b['mfu']:.1%}" if b.get("mfu") else ""
    print(f"{name}: {b['tokens_per_sec']:,.0f} tok/s, {b['tflops_per_device']:.1f} TFLOP/s{mfu}, {mem}, "
          f"{b['microbatches']} microbatch(es), accumulate_unsharded {b['accumulate_unsharded']}, "
          f"ratio to plain {b.get('ratio')}")
base = read("bench_1.3b")
for recipe in ("tensorwise", "rowwise"):
    f = read(f"fp8_{recipe}")
    if f is not None and base is not None:
        print(f"fp8 {recipe}: {f['tokens_per_sec'] / base['tokens_per_sec']:.2f}x the bf16 1.3B's tokens/s")
gate = read("fp8_gate")
if gate is not None:
    print(f"fp8_gate ({gate['steps']} steps): {'passed' if gate['passed'] else 'FAILED'} " + ", ".join(
        f"{r} {g:+.2%}" for r, g in gate["gap"].items()) + f" (threshold {gate['threshold']:.0%})")
EOF
