"""vLLM's `vllm.utils` import path, for its example scripts'
`from vllm.utils import FlexibleArgumentParser`."""

from pagellm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
