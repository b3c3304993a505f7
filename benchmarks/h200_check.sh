#!/usr/bin/env bash
# One prepared run of issue 8's single-GPU checks on a lent H200 (the device tool; about 8-10 minutes):
#   1. GPT-3 1.3B, micro-batch 8 x 2048, bf16, compiled blocks: hybridpar's full step against the plain loop
#      (launch/benchmark.py --baseline plain), and the planner's prediction of its peak memory;
#   2. GPT-3 6.7B, same batch, full activation checkpointing: speed, MFU, peak memory, and the planner's prediction.
# Results go to $OUT (JSON per run, log.txt); docs/performance.md takes the figures.
#
# Before calling it (here, once): megatron-core travels as a wheel (the machine has torch, einops, pyyaml,
# tokenizers, safetensors, sentencepiece; wandb is not needed with --logging.wandb.mode disabled):
#   mkdir -p .git/info; echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# then run it with the device tool: command `bash benchmarks/h200_check.sh`, carry [".whl"], timeout_s 600.
set -uo pipefail
OUT=${OUT:-/tmp/hybridpar-h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt"; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# hybridpar itself (hybridpar.models lives in models/ through package_dir, so it must be installed, not just on PATH)
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/hp . || { log "install failed"; exit 1; }
export PYTHONPATH=/tmp/hp:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
python3 -c "import torch, megatron.core.datasets; print('torch', torch.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$OUT/log.txt"

COMMON=(--train.seq_len 2048 --train.global_batch_size 8 --train.micro_batch_size 8 --train.precision bf16
        --train.compile true --logging.wandb.mode disabled --data.cache_dir /tmp/hpcache)
PLAN=(--cluster.nodes 1 --cluster.gpus_per_node 1 --cluster.gpu h200 --top 0 --json)

log "1.3B: hybridpar vs plain"
timeout 330 python3 launch/benchmark.py --model.name gpt3-1.3b "${COMMON[@]}" --warmup 5 --steps 15 --baseline plain \
  --json "$OUT/bench_1.3b.json" > "$OUT/bench_1.3b.txt" 2>&1 || log "1.3B benchmark exit $?"
python3 launch/plan.py --model.name gpt3-1.3b "${COMMON[@]}" "${PLAN[@]}" > "$OUT/plan_1.3b.json" 2>> "$OUT/log.txt"

log "6.7B: full activation checkpointing"
timeout 200 python3 launch/benchmark.py --model.name gpt3-6.7b "${COMMON[@]}" --train.activation_checkpointing full \
  --warmup 3 --steps 6 --json "$OUT/bench_6.7b.json" > "$OUT/bench_6.7b.txt" 2>&1 || log "6.7B benchmark exit $?"
python3 launch/plan.py --model.name gpt3-6.7b "${COMMON[@]}" --train.activation_checkpointing full "${PLAN[@]}" \
  > "$OUT/plan_6.7b.json" 2>> "$OUT/log.txt"

python3 - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for size in ("1.3b", "6.7b"):
    try:
        b = json.loads((out / f"bench_{size}.json").read_text())
        p = json.loads((out / f"plan_{size}.json").read_text())
    except (OSError, ValueError) as e:
        print(size, "missing:", e)
        continue
    peak, planned = b["peak_mem_bytes"], p["total_bytes_per_gpu"]
    print(f"{size}: {b['tokens_per_sec']:,.0f} tok/s, {b['tflops_per_device']:.0f} TFLOP/s, MFU {b['mfu']:.1%}, "
          f"peak {peak / 2**30:.1f} GiB, planner {planned / 2**30:.1f} GiB ({planned / peak - 1:+.1%}), "
          f"ratio to plain {b.get('ratio')}, split {b['split']}")
EOF
