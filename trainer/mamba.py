"""Megatron-Core's hybrid (Mamba) model on the CPU (Nemotron-H's), for the trainer and the test oracle only.

megatron-core 0.16.1's MambaMixer computes with mamba_ssm's Triton kernels (the chunked SSD scan, the gated RMSNorm)
and causal_conv1d, its module imports triton (for dynamic inference only), and its stack spec is Transformer
Engine's; none of them runs here. Stand-ins, set by `use_torch_kernels()` inside this trainer (never by reshard's
conversions):
- the scan (`mamba_chunk_scan_combined`, which the mixer calls with use_mamba_mem_eff_path off): the Mamba-2
  recurrence step by step (`ssd_scan`), state <- exp(dt A) state + dt B x, y = C state + D x, with dt the softplus of
  dt + dt_bias and head h reading B/C group h // (heads / groups): the definition that transformers' Nemotron-H
  `torch_forward` computes chunk by chunk (the oracle compares the two);
- the convolution: the mixer's own plain Conv1d and SiLU, what it does when causal_conv1d is absent;
- the gated RMSNorm (`GatedRMSNorm`): RMS-normalise x * silu(z) over each group of channels, times the weight
  (mamba_ssm's RMSNormGated with norm_before_gate off, as megatron-core builds it);
- the final norm (megatron-core's MambaStack builds Transformer Engine's TENorm) and an MoE layer's pre-MLP norm
  (TENorm in its stack spec) a plain RMSNorm;
- latent MoE's projections (Transformer Engine's TELinear in "duplicated" mode, which megatron-core's MoE layer
  requires): `DuplicatedLinear`, a plain linear under the same checkpoint keys, whole on every rank;
- the triton-only dynamic-inference helpers the mixer imports: stubs that refuse to run.
Every parameter, its name and its torch_dist key are megatron-core's own; the layers' input norms are fused into
their first linear (`norm_column_parallel_linear` with a plain RMSNorm), as Transformer Engine names them.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from reshard.trainer import cpu_compat
from reshard.trainer.gated_delta_net import norm_column_parallel_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm in fp32 (transformers' NemotronHRMSNorm's arithmetic)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    """mamba_ssm's RMSNormGated (norm after the gate), grouped, under megatron-core's ExtendedRMSNorm's checkpoint keys."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=False, device=None, dtype=None):
        super().__init__()
        if norm_before_gate:
            raise NotImplementedError("megatron-core builds the Mamba norm after the gate")
        self.eps, self.group_size = eps, group_size or hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = (x.float() * F.silu(z.float())).unflatten(-1, (-1, self.group_size))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (self.weight.float() * h).to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, return_final_states=False, **unused):
    """`mamba_chunk_scan_combined` step by step: x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n] -> y [b, l, h, p]."""
    if any(unused.get(k) is not None for k in ("seq_idx", "cu_seqlens", "initial_states")):
        raise NotImplementedError("the CPU scan runs whole sequences only")
    heads = x.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0)
    dt = F.softplus(dt) if dt_softplus else dt
    B, C = (t.float().repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    state = x.new_zeros(x.shape[0], heads, x.shape[3], B.shape[-1], dtype=torch.float32)
    ys = []
    for t in range(x.shape[1]):
        xt = x[:, t].float()
        state = state * torch.exp(dt[:, t] * A.float())[..., None, None] + (dt[:, t, :, None] * xt)[..., None] * B[:, t, :, None, :]
        y = (state * C[:, t, :, None, :]).sum(-1)
        ys.append(y + D.float()[:, None] * xt if D is not None else y)
    y = torch.stack(ys, dim=1)
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def _stub_inference_kernels() -> None:
    """mamba_mixer imports three triton helpers of dynamic inference at module level; give it stubs that refuse."""
    name = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"
    if name in sys.modules:
        return
    try:
        import triton  # noqa: F401  (the real module then imports)
        return
    except ImportError:
        pass

    def refuse(*args, **kwargs):
        raise NotImplementedError("dynamic inference needs triton")

    stub = types.ModuleType(name)
    stub.tensor_get_slice_after = stub.tensor_masked_update = stub.tensor_merge = refuse
    sys.modules[name] = stub


class FinalNorm(torch.nn.Module):
    """The plain RMSNorm in TENorm's place (MambaStack's final_norm, an MoE layer's pre_mlp_layernorm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DuplicatedLinear(torch.nn.Module):
    """TELinear in "duplicated" mode (no bias): a linear whose weight every rank holds whole, its checkpoint keys the
    weight and the (empty) extra state Transformer Engine keeps."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode, config, init_method, bias, **unused):
        super().__init__()
        if parallel_mode != "duplicated" or bias:
            raise NotImplementedError("the CPU stand-in is TELinear duplicated, without a bias (latent MoE's)")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight), None

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, None, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


def use_torch_kernels() -> None:
    """Point megatron-core's Mamba modules at the torch stand-ins above (idempotent)."""
    _stub_inference_kernels()
    cpu_compat.apply()  # the mixer's parameters made on the current device
    from megatron.core.ssm import mamba_block, mamba_mixer
    from megatron.core.transformer.moe import moe_layer

    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.causal_conv1d_fn = None
    mamba_mixer.mamba_chunk_scan_combined = ssd_scan
    mamba_mixer.ExtendedRMSNorm = GatedRMSNorm
    mamba_block.TENorm = FinalNorm
    moe_layer.HAVE_TE, moe_layer.TELinear = True, DuplicatedLinear


def hybrid_stack_spec():
    """megatron-core's MambaStack spec with local modules: each layer's input norm fused into its first linear, but an
    MoE layer's (its pre_mlp_layernorm, as megatron-core's stack spec has it); the experts megatron-core's SequentialMLP."""
    use_torch_kernels()  # before the mixer's module is first imported
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer, TransformerLayerSubmodules

    norm_linear = norm_column_parallel_linear(rms_norm, init=1.0)
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=norm_linear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}, submodules=SelfAttentionSubmodules(
            linear_qkv=norm_linear, core_attention=DotProductAttention, linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=norm_linear, linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    experts = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)  # any count builds the same spec
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=FinalNorm, mlp=experts, mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp,
                                                                         moe_layer=moe))
