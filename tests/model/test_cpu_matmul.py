"""oneDNN's packed linear layers give the dense result, and packing a tied model packs a
copy of its head while the embedding table stays a dense, loadable parameter."""

from __future__ import annotations

import pytest
import torch

from pagellm.model import cpu_matmul
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu_matmul.onednn_available(),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_and_dense_weights_match_f_linear(rows: int) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(rows, 40)
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(cpu_matmul.linear(x, cpu_matmul.pack(weight), bias), expected)
    torch.testing.assert_close(cpu_matmul.linear(x, weight, bias), expected)


def test_a_tied_head_is_packed_as_a_copy_beside_the_dense_embedding() -> None:
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 50, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for param in model.parameters():
        param.data.normal_()
    hidden = torch.randn(3, 32)
    dense = model.compute_logits(hidden)
    model.pack_weights()
    assert model.tied_head is not None and model.tied_head.is_mkldnn
    assert not model.model.embed_tokens.weight.is_mkldnn
    assert "tied_head" not in model.state_dict()
    torch.testing.assert_close(model.compute_logits(hidden), dense)
