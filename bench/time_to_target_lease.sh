#!/bin/bash
# One device lease of bench/time_to_target.py in three calls, back to back on one machine (it keeps /tmp only
# while warm, 30 s idle). Carry .whl (bench/gpu_wheels.sh), .peer (diffusers' examples/text_to_image/
# train_text_to_image.py, unmodified) and a folder holding a VAE made earlier (VAE=that folder, else the
# autoencoder job makes one, about 200 s):
#   run(carry=[".whl", ".peer", ".vae"], command="VAE=.vae bash bench/time_to_target_lease.sh ours")  # ~520 s
#   run(..., command="bash bench/time_to_target_lease.sh wait")    # the peer, started in the background by `ours`
#   run(..., command="bash bench/time_to_target_lease.sh report")  # ours scored, the figures (~60 s)
# `ours`: the data and the base, a 12-step job that fills the compile cache (its own Inductor directories),
# ours timed with empty Inductor/Triton directories (as a new container), the eval bench; then the peer alone.
set -u
case "${1:-}" in ours|peer|wait|report) ;; *) echo "usage: bash bench/time_to_target_lease.sh ours|wait|report" >&2; exit 2;; esac
if [ ! -f /tmp/site/.done ]; then  # bytecode compiled, as in an image
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.done
fi
export PYTHONPATH=functions:/tmp/site PYTHONUNBUFFERED=1
W=${W:-/tmp/ttt} CACHE=/tmp/ttt-ccache STEPS=${STEPS:-1500} OUT=${OUT:-/tmp/out}
mkdir -p $OUT
WARM="warm=--cuda-graphs true --compile true --compile-cache $CACHE"
ttt() { python3 bench/time_to_target.py --peer-script .peer/train_text_to_image.py --work $W --out $OUT/ttt.jsonl \
          --plot-dir $OUT --steps $STEPS --match-goal 0.667 "--encode-args=--compile false" "$@"; }
t0=$(date +%s)
case "${1:-}" in
ours)
  trap 'cp $W/warm.log $W/warm-run.json $OUT/ 2>/dev/null; echo "call: $(( $(date +%s) - t0 )) s"' EXIT
  [ -n "${VAE:-}" ] && mkdir -p $W/vae && cp $VAE/* $W/vae/
  ttt --prepare-only 2>&1 | grep progress; [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  mkdir -p $W/warm-shards && for f in $(ls $W/shards | grep '\.tar$' | head -2); do cp $W/shards/$f $W/warm-shards/; done
  python3 -m trainer.jobs.encode --train-dir $W/warm-shards --output-dir $W/latents-warmup --pretrained $W/base \
    --model-config small --resolution 256 --aspect-buckets false --batch-size 128 --num-workers 8 --compile false \
    > $OUT/warmup-encode.log 2>&1 || exit 1
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-a TRITON_CACHE_DIR=/tmp/tri-a python3 -m trainer.jobs.train \
    --train-dir $W/latents-warmup --model-dir /tmp/warmup-model --checkpoint-dir /tmp/warmup-ck --resume none \
    --pretrained $W/base --init-unet pretrained --model-config small --steps 12 --batch-size 128 --resolution 256 \
    --learning-rate 2e-4 --max-grad-norm 1 --ema-decay 0 --final-weights trained --caption-dropout 0 \
    --aspect-buckets false --random-crop false --num-workers 8 --checkpoint-every 150 --log-every 4 \
    --validation-prompts "" --seed 0 --cuda-graphs true --compile true --compile-cache $CACHE > $OUT/warmup.log 2>&1 || exit 1
  echo "compile cache filled at $(( $(date +%s) - t0 )) s"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-b TRITON_CACHE_DIR=/tmp/tri-b ttt --ours "$WARM" --runs ours 2>&1 | grep progress; [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  python3 bench/eval_losses.py --model-config small --resolution 256 --samples 256 --rounds 3 2>&1 | grep metric | tee $OUT/eval.jsonl
  setsid nohup bash -c "OUT=$W bash bench/time_to_target_lease.sh peer > $W/peer-bg.out 2>&1; echo \$? > $W/peer.done" \
    > /dev/null 2>&1 < /dev/null &
  ;;
peer)
  ttt --runs peer --score-losses
  ;;
wait)
  while [ ! -f $W/peer.done ] && [ $(( $(date +%s) - t0 )) -lt 570 ]; do sleep 3; done
  echo "peer: rc=$(cat $W/peer.done 2>/dev/null || echo 'still running: call wait again')"
  grep '"event"' $W/peer-bg.out | tail -10
  ;;
report)
  ttt --ours "$WARM" --runs ours --score-losses 2>&1 | grep '"event"'
  ttt --ours "$WARM" --target final --skip-match 2>&1 | grep metric
  cp $W/*-scores.json $W/*-run.json $OUT/ 2>/dev/null || true  # the runs' raw records, best effort
  ;;
esac

