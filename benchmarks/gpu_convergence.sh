# One device call for the convergence study: build the ops once (so the launches do not race to build them),
# then benchmarks/convergence.py on h200.json with CONV_ARGS (seeds, steps, --parallel ...). The work dir
# (configs, summaries, csv, logs) goes under $OUT as one work.tar (the device returns at most 8 files), so a
# timed-out study can be collected later with --reuse.
# Usage (from the repo root, .whl carried):
#   CONV_ARGS="--steps 600 --seeds 1 2 3 4 --parallel 12 --name h200_600_seeds" bash benchmarks/gpu_convergence.sh
source benchmarks/gpu_setup.sh || exit 1
cp -r benchmarks train.py ds_configs /tmp/pkg/ && cd /tmp/pkg || exit 1
( time python3 -c "from lrmoe_ds import ops; print(ops.cuda_ops_status())" ) > $OUT/build.log 2>&1; tail -4 $OUT/build.log
(while sleep 20; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done) \
  > $OUT/gpu_use.log 2>&1 &
# CONV_ARGS last: its --extra takes the rest of the line to train.py
timeout ${CONV_TIMEOUT:-480} python3 benchmarks/convergence.py --base_config ds_configs/h200.json --num_gpus 1 \
  --out_dir $OUT --work_dir $OUT/work ${CONV_ARGS:-} > $OUT/convergence.log 2>&1; echo "convergence rc=$?"
kill %1 2>/dev/null; echo "GPU memory, utilization every 20 s:" $(cat $OUT/gpu_use.log | tr '\n' ';')
grep -E "held-out loss|FAILED" $OUT/convergence.log | tail -20
sed -n '/^| seed/,/^Mean/p' $OUT/convergence_*.md 2>/dev/null
tar -cf $OUT/work.tar -C $OUT work && rm -rf $OUT/work
