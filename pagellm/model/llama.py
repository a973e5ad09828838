"""The Llama-family decoder: Llama 2/3, SmolLM, Mistral, Qwen2 and Qwen3.

These differ only in flags the ModelConfig resolves: q/k/v (and o) bias, per-head q/k
RMSNorm (Qwen3), sliding-window layers (Mistral, some Qwen configs), tied lm_head, and the
rope frequencies. One class serves them all so a fix lands once.

The batch is flat: T tokens of all requests, no batch dimension. Attention is delegated to
the backend chosen at start-up; everything else is per-token and batch-agnostic.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from pagellm.model import cpu_kernels, cpu_matmul, quant_kernels
from pagellm.model.attention import (
    AttentionBackend,
    AttentionSpec,
    StepPlan,
    allocate_kv_caches,
    get_attention_backend,
)
from pagellm.model.attention_metadata import AttentionMetadata
from pagellm.model.errors import CorruptModelError
from pagellm.model.layers import Embedding, GatedMLP, Linear, RMSNorm
from pagellm.model.model_config import ModelConfig
from pagellm.model.rotary import RotaryEmbedding, apply_rotary

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection over the paged KV cache."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.spec = AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=config.layer_sliding_window(layer_idx),
        )
        self.backend = backend
        # Rotate q and k in place in the qkv output with one compiled op (set by the
        # loader with the CPU kernels; not with q/k norms, which come before the rotation).
        self.fused_rotary = False

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: StepPlan,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        fused = self.fused_rotary and qkv.dtype == torch.float32 and qkv.is_contiguous()
        if fused:
            torch.ops.pagellm.rotary_(qkv, self.num_heads + self.num_kv_heads, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if not fused:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, plan, self.spec)
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.q_size))
        return projected


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is carried beside the block's output, as vLLM does: a layer
    returns (mlp output, stream) and the next one adds them in the same op as its input
    norm (`RMSNorm.add_norm`), so each add + norm is one op when fused."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        # qkv, o, gate_up (gated) and down's blocks while the layer runs fused (see
        # use_fused_layer).
        self.fused_weights: tuple[quant_kernels.QuantizedWeight, ...] | None = None
        self.decode_args: tuple[object, ...] | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: StepPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: the previous layer's output not yet added to `residual`, the stream
        (None before the first layer, when `hidden` is the embedding)."""
        if self.fused_weights is not None:
            # Three calls (attention input, attention, attention output) instead of ~40
            # Python-level ones: on a 1-request decode step those took ~190 us per layer
            # outside any kernel. A step that is one decode-kernel call makes one call a
            # layer: alternating in one process, a decode step of 1 request 10.6-11.3 ->
            # 9.9-10.4 ms, of 8 26.3-27.2 -> 23.7-24.3 ms, of 32 sharing a prefix 48.8-49.0
            # -> 46.9-47.3 ms.
            if plan.decode_call is not None:
                assert self.decode_args is not None
                decoded: tuple[torch.Tensor, torch.Tensor] = torch.ops.pagellm.decode_layer(
                    hidden, residual, cos, sin, kv_cache, plan.meta.slot_mapping,
                    *plan.decode_call, *self.decode_args)
                return decoded
            attention = self.self_attn
            qkv_w, o_w, gate_up_w, down_w = self.fused_weights
            qkv, residual = torch.ops.pagellm.attention_input(
                hidden, residual, self.input_layernorm.weight, self.input_layernorm.eps,
                *qkv_w.op_args(), cos, sin, attention.num_heads + attention.num_kv_heads, kv_cache,
                plan.meta.slot_mapping)
            q = qkv[:, : attention.q_size].view(-1, attention.num_heads, attention.head_dim)
            out = attention.backend.attend(q, kv_cache, plan, attention.spec)
            norm = self.post_attention_layernorm
            fused: tuple[torch.Tensor, torch.Tensor] = torch.ops.pagellm.attention_output(
                out.reshape(-1, attention.q_size), residual, *o_w.op_args(), norm.weight, norm.eps,
                *gate_up_w.op_args(), *down_w.op_args())
            return fused
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_norm(hidden, residual)
        attn: torch.Tensor = self.self_attn(normed, cos, sin, kv_cache, plan)
        normed, residual = self.post_attention_layernorm.add_norm(attn, residual)
        mlp: torch.Tensor = self.mlp(normed)
        return mlp, residual

    def use_fused_layer(self) -> bool:
        """Run the layer as the compiled layer ops (csrc/decoder_layer.cpp) when
        everything outside attention has a kernel: blocks without biases for every matmul,
        the gated MLP kernel, and the fused norms and rotary; returns whether it does.
        Decided once here, not per call: the checks cost ~25 us per layer per step."""
        attn, mlp = self.self_attn, self.mlp
        gate_up = mlp.gate_up_proj.quantized
        weights = (attn.qkv_proj.quantized, attn.o_proj.quantized, gate_up,
                   mlp.down_proj.quantized)
        fits = (gate_up is not None and gate_up.gated
                and all(weight is not None for weight in weights) and attn.fused_rotary
                and self.input_layernorm.fused and self.post_attention_layernorm.fused
                and attn.qkv_proj.bias is None and attn.o_proj.bias is None
                and mlp.down_proj.bias is None)
        self.fused_weights = weights if fits else None  # type: ignore[assignment]
        self.decode_args = None
        if self.fused_weights is not None:
            # decode_layer's arguments after the step's, in its order: the same every step.
            qkv_w, o_w, gate_up_w, down_w = self.fused_weights
            self.decode_args = (
                self.input_layernorm.weight, self.input_layernorm.eps, *qkv_w.op_args(),
                attn.num_heads, attn.spec.scale, *o_w.op_args(),
                self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                *gate_up_w.op_args(), *down_w.op_args())
        return fits


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the `model.` prefix of checkpoints)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        layers = [LlamaDecoderLayer(config, i, backend) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        backend.configure([layer.self_attn.spec for layer in layers])

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        plan: StepPlan,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, plan)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_norm(hidden, residual)[0]


# Checkpoint tensors that land in a slice of one of our fused weights:
# checkpoint name fragment -> (our fragment, shard index in the fused output dimension).
_FUSED_SHARDS: dict[str, tuple[str, int]] = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """Decoder + lm_head with the PageLLM model interface.

    - `forward(input_ids[T], positions[T], kv_caches, attn_metadata) -> hidden[T, H]`
      (`forward_planned` with the backend's plan already made)
    - `compute_logits(hidden[N, H]) -> float32 logits[N, vocab]`
    - KV cache: one `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer,
      see `kv_cache_shape` / `allocate_kv_caches`.
    Parameter names follow the Hugging Face checkpoints (`model.layers.N....`), except the
    fused `qkv_proj` and `gate_up_proj`, which `load_weights` assembles.
    """

    def __init__(self, config: ModelConfig, attention_backend: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = get_attention_backend(attention_backend)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.model = LlamaModel(config, self.attn_backend)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # A tied head's table is also the embedding, which must stay dense for lookups;
        # pack_weights may add a packed copy of it for the matmul.
        self.tied_head: torch.Tensor | None
        self.register_buffer("tied_head", None, persistent=False)
        # A tied head's own quantized blocks, for the kernel (attach_quantized).
        self.quantized_head: quant_kernels.QuantizedWeight | None = None
        # Whether attention rounds keys and values to bfloat16 wherever it reads them
        # (row-invariant, with bfloat16 products): then a bfloat16 pool changes no output.
        self.attention_rounds_kv_to_bf16 = False

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return self.config.kv_cache_shape(num_blocks, block_size)

    def allocate_kv_caches(self, num_blocks: int, block_size: int,
                           dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Zero-filled caches on the model's device, one per layer, of `dtype` (None: the
        model's; see EngineConfig.kv_cache_dtype)."""
        weight = self.model.embed_tokens.weight
        shape = self.kv_cache_shape(num_blocks, block_size)
        return allocate_kv_caches(self.num_layers, shape, dtype or weight.dtype, weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.forward_planned(input_ids, positions, kv_caches,
                                    self.attn_backend.prepare(attn_metadata))

    def forward_planned(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        plan: StepPlan,
    ) -> torch.Tensor:
        """`forward` with the attention plan already made: a CUDA graph captures this with
        a GraphDecodePlan, which is made once per captured shape, not per step."""
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.rotary.cos_sin(positions, dtype)
        hidden: torch.Tensor = self.model(input_ids, cos, sin, kv_caches, plan)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(hidden)
            return logits.float()
        if self.quantized_head is not None:
            return quant_kernels.quantized_linear(hidden, self.quantized_head)
        head = self.tied_head if self.tied_head is not None else self.model.embed_tokens.weight
        return cpu_matmul.linear(hidden, head, None).float()

    def use_cpu_kernels(self) -> None:
        """Switch to the compiled CPU kernels (cpu_kernels, once loaded): paged attention
        paths, fused norms, silu * up and rotary (csrc/fused_ops.cpp)."""
        self.attn_backend.use_cpu_kernels()
        for module in self.modules():
            if isinstance(module, (RMSNorm, GatedMLP)):
                module.fused = True
            elif isinstance(module, LlamaAttention):
                module.fused_rotary = module.q_norm is None
        self._use_fused_layers()

    def _use_fused_layers(self) -> None:
        """Layers whose kernels are all in place run as the compiled layer ops; called
        whenever kernels or blocks change (use_cpu_kernels, attach_quantized)."""
        for module in self.modules():
            if isinstance(module, LlamaDecoderLayer):
                module.use_fused_layer()

    def pack_weights(self) -> None:
        """Pack every linear layer's weight for oneDNN (see cpu_matmul) unless its quantized
        blocks serve it; a no-op on devices and dtypes oneDNN does not serve. Call once,
        after load_weights and attach_quantized.

        A tied head without blocks gets a packed copy beside the dense embedding table: the
        vocabulary matmul is the largest of a decode step (113 MB of float32 for SmolLM2),
        and packed it takes 2.4 instead of 4.0 ms for 8 rows, for that much more memory."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        table = self.model.embed_tokens.weight
        if (self.lm_head is None and self.tied_head is None and self.quantized_head is None
                and cpu_matmul.serves(table)):
            self.tied_head = cpu_matmul.pack(table)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Put checkpoint tensors (HF names) into our parameters, filling fused shards.

        A tensor that already has the parameter's dtype and device is adopted as it is, not
        copied: from safetensors that is a copy-on-write mapping of the file, so most of a
        checkpoint never costs a copy at start-up. Fused and cast tensors are copied.
        Raises CorruptModelError naming the first tensor that is missing, unexpected or of
        the wrong shape, instead of leaving a silently half-initialised model.
        """
        # Derived from the old weights: pack_weights and attach_quantized redo them.
        self.tied_head = None
        self.quantized_head = None
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantized = None
        self._use_fused_layers()
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints still store the (identical) head
            if "rotary_emb." in name:
                continue  # derived buffers, recomputed from the config
            target, shard = self._target(name)
            param = params.get(target)
            if param is None:
                raise CorruptModelError(f"checkpoint tensor {name!r} has no place in the model")
            dest = param.data if shard is None else self._shard(param.data, target, shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise CorruptModelError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            if shard is None and tensor.dtype == dest.dtype and tensor.device == dest.device:
                param.data = tensor
            else:
                dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + 1
        for target in params:
            if filled.get(target, 0) != self._shard_count(target):
                raise CorruptModelError(f"checkpoint is missing weights for {target!r}")

    def attach_quantized(self, blocks: Iterable[tuple[str, str, torch.Tensor]],
                         int8_activations: bool = False) -> int:
        """Give linear layers (and a tied head) their checkpoint's raw quantized blocks,
        as (HF name, GGUF format, blocks in GGUF byte order), for the kernels;
        returns how many weights got them. A fused layer gets them only when every shard
        has them, in one format. With `int8_activations`, the blocks go to the kernel that
        quantizes its inputs to int8 (see EngineConfig.quantize_activations).

        Call after load_weights and before pack_weights: rows sampled from every weight are
        dequantized and must equal the loaded float32 weights bit for bit, else this raises
        CorruptModelError (blocks that do not belong to these weights).
        """
        parts: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}
        for name, format_name, raw in blocks:
            if name == "model.embed_tokens.weight" and self.lm_head is None:
                name = "tied_head"
            target, shard = self._target(name)
            parts.setdefault(target, {})[0 if shard is None else shard] = (format_name, raw)
        modules = dict(self.named_modules())
        attached = 0
        for target, shards in parts.items():
            module = modules.get(target.removesuffix(".weight"))
            if target == "tied_head":
                weight = self.model.embed_tokens.weight
            elif isinstance(module, Linear) and len(shards) == self._shard_count(target):
                weight = module.weight
            else:
                continue
            names = {name for name, _ in shards.values()}
            if len(names) != 1:  # shards in two formats (q in Q4_1, v in Q8_0): rows differ
                continue
            raw = torch.cat([shards[i][1] for i in sorted(shards)])
            if (weight.is_mkldnn or weight.dtype != torch.float32
                    or raw.shape[0] != weight.shape[0]
                    or not quant_kernels.packable(*weight.shape)):
                continue
            fmt = quant_kernels.FORMATS[names.pop()]
            rows = torch.arange(0, weight.shape[0], max(1, weight.shape[0] // 16))
            sample = quant_kernels.dequantize(fmt, raw[rows], weight.shape[1])
            if not torch.equal(sample, weight.detach()[rows]):
                raise CorruptModelError(
                    f"the {fmt.name} blocks of {target!r} do not match its float32 weights")
            packed = quant_kernels.pack(fmt, raw, weight.shape[1])
            if int8_activations:
                packed = quant_kernels.int8_activation_layout(packed)
            if isinstance(module, Linear):
                module.quantized = packed
            else:
                self.quantized_head = packed
            attached += 1
        for module in self.modules():
            if isinstance(module, GatedMLP):
                module.use_gated_kernel()
        if int8_activations:
            self._make_rows_invariant()
        self._use_fused_layers()
        return attached

    def _make_rows_invariant(self) -> None:
        """With int8 activations, every layer's result for a token must not depend on the
        batch it is computed in (int8 rounding would turn float32 noise into whole
        steps): puts attention on its row-invariant path, with its products in bfloat16
        where the kernels have them (AVX-512 BF16: twice an FMA's work per instruction;
        llama.cpp's CPU attention rounds queries and keys to float16, 11 significant bits
        where bfloat16 keeps 8), and says in the log where that cannot hold, so that
        caching may change outputs. The head only makes logits, which no layer reads
        again."""
        floats = [name for name, module in self.named_modules()
                  if name.startswith("model.layers.") and isinstance(module, Linear)
                  and (module.quantized is None or not module.quantized.int8_activations)]
        if floats:
            logger.warning("quantize_activations: %d layer weights have no Q4_1 or Q8_0 "
                           "blocks the kernels take (e.g. %s) and stay float32, so caching "
                           "may change outputs", len(floats), floats[0])
        bf16_products = cpu_kernels.bf16_products()
        if not self.attn_backend.use_row_invariant_attention(bf16_products):
            logger.warning("quantize_activations: attention (the %s backend) cannot take "
                           "every token through one row-invariant kernel here (that needs "
                           "the default backend, its compiled kernels serving every layer), "
                           "so caching may change outputs", self.attn_backend.name)
        else:
            self.attention_rounds_kv_to_bf16 = bf16_products

    def int8_activation_weights(self) -> int:
        """How many weights run on the int8-activation kernel (attach_quantized)."""
        weights = [module.quantized for module in self.modules() if isinstance(module, Linear)]
        return sum(weight is not None and weight.int8_activations
                   for weight in (*weights, self.quantized_head))

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        for fragment, (fused, shard) in _FUSED_SHARDS.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None

    def _shard(self, data: torch.Tensor, target: str, shard: int) -> torch.Tensor:
        if ".qkv_proj." in target:
            q, kv = self.config.num_attention_heads, self.config.num_key_value_heads
            sizes = [q * self.head_dim, kv * self.head_dim, kv * self.head_dim]
        else:
            sizes = [self.config.intermediate_size] * 2
        return torch.split(data, sizes, dim=0)[shard]

    @staticmethod
    def _shard_count(target: str) -> int:
        if ".qkv_proj." in target:
            return 3
        if ".gate_up_proj." in target:
            return 2
        return 1
