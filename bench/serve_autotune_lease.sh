#!/bin/bash
# serve.lever.compile (max-autotune, no CUDA graphs) in calls of one device lease: Inductor's and Triton's caches
# live in /tmp, which the machine keeps only while warm (30 s idle), so each call goes on where the previous one's
# autotuning stopped. Carry .whl (bench/gpu_wheels.sh) and .devrun/env.sh (installs the wheels into /tmp/site).
#   run: bash bench/serve_autotune_lease.sh      (repeat at once; LIMIT/DEADLINE in seconds, and any
#        TORCHINDUCTOR_MAX_AUTOTUNE_CONV_BACKENDS=ATEN to autotune GEMMs only)
. .devrun/env.sh >/dev/null
export PYTHONPATH=functions:$PYTHONPATH
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-autotune TRITON_CACHE_DIR=/tmp/tri-autotune
mkdir -p $TORCHINDUCTOR_CACHE_DIR
echo "conv backends: ${TORCHINDUCTOR_MAX_AUTOTUNE_CONV_BACKENDS:-default (ATEN,TRITON)}"
call=$(ls /tmp/autotune-call-* 2>/dev/null | wc -l); call=$((call + 1)); touch /tmp/autotune-call-$call
echo "call $call; cache before: $(du -sm $TORCHINDUCTOR_CACHE_DIR | cut -f1) MiB, $(find $TORCHINDUCTOR_CACHE_DIR -type f | wc -l) files"
t0=$(date +%s)
( while sleep 30; do
    echo "t=$(( $(date +%s) - t0 )) s cache $(du -sm $TORCHINDUCTOR_CACHE_DIR | cut -f1) MiB $(find $TORCHINDUCTOR_CACHE_DIR -type f | wc -l) files, triton $(find $TRITON_CACHE_DIR -name '*.cubin' 2>/dev/null | wc -l) cubins"
  done ) > $OUT/progress-$call.log &
timeout ${LIMIT:-570} python3 bench/serve_gpu.py --no-headline --no-cold-start --levers compile --compile-needs 0 \
  --deadline ${DEADLINE:-560} --out $OUT/serve-$call.jsonl > $OUT/serve-$call.log 2>&1
echo "rc=$? after $(( $(date +%s) - t0 )) s"
kill %1
tail -3 $OUT/progress-$call.log
grep metric $OUT/serve-$call.jsonl | cut -c1-600
echo "autotuned $(grep -c '^AUTOTUNE ' $OUT/serve-$call.log) ops; last: $(grep '^AUTOTUNE ' $OUT/serve-$call.log | tail -1)"
