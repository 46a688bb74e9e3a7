#!/bin/bash
# One device lease of bench/family_ttt.py (and the encode job's text-embedding throughput) in calls back to
# back on one machine (it keeps /tmp only while warm, 30 s idle). Carry .whl (bench/gpu_wheels.sh):
#   run(carry=[".whl"], command="bash bench/family_ttt_lease.sh dit")     # data, VAE, bases, the DiT run (~450 s)
#   run(carry=[".whl"], command="bash bench/family_ttt_lease.sh runs")    # or both runs in one call (BUDGET=180)
#   run(carry=[".whl"], command="LIMIT=550 bash bench/family_ttt_lease.sh all")  # or everything in one call, cut at LIMIT s
#   run(carry=[".whl"], command="bash bench/family_ttt_lease.sh unet")    # the UNet run, then both scored, the report
#   run(carry=[".whl"], command="bash bench/family_ttt_lease.sh score")   # what `unet` did not finish scoring
#   run(carry=[".whl"], command="bash bench/family_ttt_lease.sh encode")  # bench/encode_text.py, full-size presets
# Where machines do not stay warm between calls, one family per call (BUDGET=300 fits one in 600 s):
#   run(carry=[".whl"], command="BUDGET=300 bash bench/family_ttt_lease.sh one dit")
#   then put the files it brought back (vae/, dit-run.json, dit-scores.json) in .fttt/ here and
#   run(carry=[".whl", ".fttt"], command="BUDGET=300 bash bench/family_ttt_lease.sh one unet")  # same VAE; reports
set -u
case "${1:-}" in dit|unet|runs|all|score|encode) ;; one) case "${2:-}" in dit|unet) ;; *) echo "usage: ... one dit|unet" >&2; exit 2;; esac;;
  *) echo "usage: bash bench/family_ttt_lease.sh dit|unet|runs|all|score|encode|one FAMILY [family_ttt flags]" >&2; exit 2;; esac
MODE=$1; shift
if [ "$MODE" = one ]; then FAMILY=$1; shift; fi
if [ ! -f /tmp/site/.done ]; then  # bytecode compiled, as in an image
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.done
fi
export PYTHONPATH=functions:/tmp/site PYTHONUNBUFFERED=1
W=${W:-/tmp/fttt} OUT=${OUT:-/tmp/out} BUDGET=${BUDGET:-240}
mkdir -p $OUT
quiet() { grep -v 'clean_caption\|beautifulsoup\|restart your runtime\|^$\|Loading\|float32\|Warning'; }
EXTRA=("$@")
if [ -d .fttt ]; then  # an earlier call's records and VAE (see above)
  mkdir -p $W && cp .fttt/*.json $W/ 2>/dev/null
  [ -d .fttt/vae ] && EXTRA+=(--vae .fttt/vae)
fi
ft() { timeout ${LIMIT:-9999} python3 bench/family_ttt.py --work $W --out $OUT/family.jsonl --plot-dir $OUT --budget-s $BUDGET "$@" "${EXTRA[@]}"; }
t0=$(date +%s)
trap 'cp $W/*-run.json $W/*-scores.json $OUT/ 2>/dev/null; [ -f $W/vae/config.json ] && cp -r $W/vae $OUT/; for f in $W/dit.log $W/unet.log; do [ -f $f ] && tail -c 20000 $f > $OUT/$(basename $f); done; echo "call: $(( $(date +%s) - t0 )) s"' EXIT
case "$MODE" in
one) ft --families $FAMILY --score 2>&1 | quiet | tail -60 ;;
runs) ft --families dit,unet 2>&1 | quiet | tail -40 ;;
all) ft --families dit,unet --score 2>&1 | quiet | tail -60 ;;
dit) ft --families dit 2>&1 | quiet | tail -40 ;;
unet) ft --families unet --score 2>&1 | quiet | tail -60 ;;
score) ft --families "" --score 2>&1 | quiet | tail -60 ;;
encode) python3 bench/encode_text.py --model-config pixart-sigma,sd3-medium --captions 1024 --batch 128 --repeats 3 2>&1 \
          | quiet | tee $OUT/encode.jsonl | tail -20 ;;
esac
