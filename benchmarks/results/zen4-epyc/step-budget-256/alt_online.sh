#!/bin/bash
# usage: alt_online.sh MODE(int8|f32) PAIRS RATE [WORKLOAD, default shared-prefix]
m=$1; n=$2; rate=$3; w=${4:-shared-prefix}
flag=""; [ "$m" = int8 ] && flag=--quantize-activations
for i in $(seq $n); do
  for b in 512 256; do
    [ $((i%2)) = 0 ] && b=$((768-b))
    o=/tmp/s47/alt-online/$w-$m-rate$rate-$b-$i
    HF_HUB_OFFLINE=1 pagellm bench --workload $w --mode online --request-rate $rate --contenders pagellm $flag --max-num-batched-tokens $b --output-dir $o > /dev/null 2>&1
    python -c "
import json;r=json.load(open('$o/results.json'))['comparisons'][0]['runs'][0]
print('$m rate $rate $b $i wall %.3f ttft mean %.3f p50 %.3f p90 %.3f itl mean %.4f p99 %.3f'%(r['wall_s'],r['ttft']['mean'],r['ttft']['p50'],r['ttft']['p90'],r['itl']['mean'],r['itl']['p99']))"
  done
done
