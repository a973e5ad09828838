"""vLLM's import path `vllm.sampling_params`, where its examples import the request
parameters from; the definitions are in `pagellm.core.sampling_params`."""

from pagellm.core.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams"]
