#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA device and PyTorch, run from the repository root
# without installing the project: the CUDA tests, the padded-decode tests and the tiny-model
# exactness suite (the engine picks CUDA by itself when torch sees a GPU), then offline
# speed runs (caching on and off, transformers generate on the same GPU, and PageLLM again
# with --enforce-eager: decode steps launched op by op instead of replayed from CUDA graphs,
# and at the CPU's 256-token step budget, to weigh it against the GPU's default 512)
# and the decode-step table of benchmarks/bench_cuda_graphs.py, on a random-weight model of
# the default model's shape. About 7 minutes on an H200.
# Usage: bash scripts/gpu_check.sh SHAPE_DIR OUT_DIR
#   SHAPE_DIR holds the default model's config.json and tokenizer files (its weights do
#   not need to travel); OUT_DIR gets the test log and each workload's results.
set -uo pipefail
shape=$1
out=$2
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
    tests/engine/test_cuda_graphs.py tests/engine/test_exactness_tiny.py 2>&1 \
    | tee "$out/pytest.log"
status=$?
model=$(mktemp -d)/model
python3 benchmarks/random_weights_model.py "$shape" "$model" >/dev/null || exit 1
bench() {
    local name=$1
    shift
    python3 -m pagellm.entrypoints.cli bench --repeats 3 --model "$model" \
        --output-dir "$out/$name" "$@" > "$out/$name.log" 2>&1 || status=1
    grep -v "it/s\]" "$out/$name.log" | grep "^| \|FAIL\|PASS\|rror" | tail -30
}
for workload in shared-prefix multi-turn; do
    bench "$workload" --workload "$workload" --contenders pagellm,pagellm-nocache,hf-generate
    bench "$workload-eager" --workload "$workload" --contenders pagellm --enforce-eager
    bench "$workload-budget-256" --workload "$workload" --contenders pagellm \
        --max-num-batched-tokens 256
done
python3 benchmarks/bench_cuda_graphs.py "$model" --out "$out/decode-steps.md" \
    > "$out/decode-steps.log" 2>&1 || status=1
grep "^|" "$out/decode-steps.log" | tail -10
exit $status
