# One device call: bench_train.py (train.py end to end) with this working tree's library and, where a folder of an
# older one is given, the retention run with that one too, in turns: new exact and retention, old retention, new
# DeepSpeed, old retention again, as long as TRAIN_SECONDS (default 480) allow.
# Usage (from the repo root, .whl carried):
#   bash benchmarks/gpu_train_ab.sh                 # this library alone
#   mkdir ab_old && git archive <old commit> lrmoe_ds ops | tar -x -C ab_old && bash benchmarks/gpu_train_ab.sh ab_old
# TRAIN_ARGS: bench_train.py's arguments before --extra (default: h200.json, 24 steps, 4 micro-steps of 4 x 2048 tokens,
# retention 0.5); TRAIN_EXTRA: train.py's flags (default: 4 layers of the Qwen3-30B-A3B layer shape). Tables, logs to $OUT.
old=${1:-}
source benchmarks/gpu_setup.sh || exit 1
if [ -n "$old" ]; then
  rm -rf /tmp/pkgold && mkdir -p /tmp/pkgold && cp -r "$old/lrmoe_ds" /tmp/pkgold/ && cp -r "$old/ops" /tmp/pkgold/lrmoe_ds/ops || exit 1
fi
cp -r tests pytest.ini benchmarks train.py ds_configs /tmp/pkg/ && cd /tmp/pkg || exit 1
build='from lrmoe_ds import ops; print(ops.cuda_ops_status())'
[ -n "$old" ] && ( TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=/tmp/pkgold:/tmp/site MAX_JOBS=8 python3 -c "$build" \
  > /tmp/build_old.log 2>&1 ) &
( time MAX_JOBS=8 python3 -c "$build" ) > $OUT/build.log 2>&1; tail -4 $OUT/build.log; wait
args=${TRAIN_ARGS:---base_config ds_configs/h200.json --num_gpus 1 --steps 24 --warmup_steps 6 --log_every 3 --grad_accum 4 --micro_batch 4 --ratios 0.5}
extra=${TRAIN_EXTRA:---layers 4 --hidden 2048 --heads 16 --experts 128 --ffn 768 --top_k 8 --seq_len 2048 --train_bytes 4194304 --eval_bytes 65536 --no-stdlib_tests}
one() {  # library, runs, name (--reuse: the name's earlier runs are collected, not run again)
  [ $1 = old ] && [ -z "$old" ] && return
  left=$((${TRAIN_SECONDS:-480} - SECONDS)); [ $left -lt 50 ] && { echo "no time left for $1 [$2]"; return; }
  if [ $1 = old ]; then env="TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=/tmp/pkgold:/tmp/site"; else env=""; fi
  env $env timeout $left python3 benchmarks/bench_train.py $args --runs $2 --reuse --name $3 --out_dir $OUT \
    --work_dir /tmp/train_$3 --extra $extra > /tmp/train_$3.log 2>&1
  echo "$1 [$2] rc=$? at ${SECONDS}s"; grep -E '^\| (LRMoE|DeepSpeed)' /tmp/train_$3.log | cut -d'|' -f2,4,5,6,7,8
}
one new retention new; one old retention old; one new "exact retention" new; one new "deepspeed exact retention" new
one old retention old2
tar czf $OUT/train_logs.tgz -C /tmp $(cd /tmp && ls -d train_new train_old train_old2 2>/dev/null)
