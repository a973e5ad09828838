#!/bin/bash
# usage: alt.sh WORKLOAD MODEFLAG(int8|f32) N
w=$1; m=$2; n=$3
flag=""; [ "$m" = int8 ] && flag=--quantize-activations
for i in $(seq $n); do
  for b in 512 256; do
    [ $((i%2)) = 0 ] && b=$((768-b))
    HF_HUB_OFFLINE=1 pagellm bench --workload $w --contenders pagellm $flag --max-num-batched-tokens $b --output-dir /tmp/s47/alt/$w-$m-$b-$i > /dev/null 2>&1
    python -c "
import json,sys;r=json.load(open('/tmp/s47/alt/$w-$m-$b-$i/results.json'))['comparisons'][0]['runs'][0]
print('$w $m $b $i wall %.3f ttft %.3f itl99 %.3f steps %s'%(r['wall_s'],r['ttft']['mean'],r['itl']['p99'],r['engine'].get('num_steps', r.get('steps','?'))))"
  done
done
