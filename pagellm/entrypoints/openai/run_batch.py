"""vLLM's module path of its batch runner, `python -m vllm.entrypoints.openai.run_batch
-i IN -o OUT --model M`: run as `python -m pagellm.entrypoints.openai.run_batch`, it is
`pagellm run-batch` with the same options (defined in `pagellm.entrypoints.run_batch`)."""

import sys

if __name__ == "__main__":
    from pagellm.entrypoints.cli import main

    sys.exit(main(["run-batch", *sys.argv[1:]]))
