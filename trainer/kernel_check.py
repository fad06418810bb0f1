"""Do the CPU stand-ins of `gated_delta_net` and `mamba` compute what the GPU kernels compute? Run on a CUDA machine:
`python -m reshard.trainer.kernel_check` (megatron-core, flash-linear-attention and mamba_ssm's Triton ops installed).

The CPU oracle of the hybrid families (tests/converters/test_hf_logits.py) runs megatron-core's GatedDeltaNet and
MambaMixer on torch stand-ins of the kernels they call on a GPU. Here each tiny hybrid preset is built once on the GPU,
its weights made large enough that every term counts, and run on the same tokens twice: with the stand-ins, and with
the kernels megatron-core imports (flash-linear-attention's `chunk_gated_delta_rule` and `l2norm`; mamba_ssm's
`mamba_chunk_scan_combined` and its gated RMSNorm, the class megatron-core's `ExtendedRMSNorm` extends). Each mixer's
output and the logits must agree to fp32 rounding, relative to their largest magnitude; and one deliberate error per
kernel (the q/k l2norm skipped, the skip connection D dropped) must not. The causal convolution is megatron-core's own
Conv1d fallback on both sides (causal_conv1d, a CUDA extension, is left out), and Transformer Engine's norms and linears
stay the trainer's local ones: neither is a stand-in for a kernel the mixers call.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from reshard.layout import Layout
from reshard.trainer import mamba
from reshard.trainer.model import build_model, init_parallel
from reshard.trainer.presets import PRESETS

TOLERANCE = 1e-4  # relative: fp32 on both sides (TF32 off in torch and Triton), sums chunked in another order; an H200 measured 2.8e-5
SABOTAGE_FLOOR = 1e-2  # a deliberate error must move the outputs at least this much, or the check proves nothing
CHECKED = {"tiny-qwen3-next": 128, "tiny-nemotron-h": 256, "tiny-nemotron-h-latent": 256}  # preset: tokens (2 chunks)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What megatron-core's mixers call, by the module-global names they call them by."""

    chunk_gated_delta_rule: Callable
    l2norm: Callable
    mamba_chunk_scan_combined: Callable
    gated_norm: Callable[[mamba.GatedRMSNorm], torch.nn.Module]  # the mixer's norm, on the same weight


def _import_mamba_ssm_ops() -> None:
    """mamba_ssm's package __init__ imports its selective-scan CUDA extension, which the Triton ops megatron-core calls
    do not need: without the extension built, make the package importable for those ops alone."""
    try:
        import mamba_ssm  # noqa: F401
    except ImportError:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None:
            raise SystemExit("kernel_check: mamba_ssm is not installed (its source tree on PYTHONPATH is enough)") from None
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = package


def gpu_kernels() -> Kernels:
    _import_mamba_ssm_ops()
    from fla.modules.l2norm import l2norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from mamba_ssm.ops.triton.layernorm_gated import RMSNorm
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    def gated_norm(norm: mamba.GatedRMSNorm) -> torch.nn.Module:
        kernel = RMSNorm(norm.weight.numel(), eps=norm.eps, group_size=norm.group_size, norm_before_gate=False)
        kernel.weight = norm.weight
        return kernel

    return Kernels(chunk_gated_delta_rule, l2norm, mamba_chunk_scan_combined, gated_norm)


@contextmanager
def calling(model: torch.nn.Module, kernels: Kernels) -> Iterator[None]:
    """The model's mixers call `kernels` inside the block, and what they called before after it."""
    from megatron.core.ssm import gated_delta_net, mamba_mixer

    saved = (gated_delta_net.chunk_gated_delta_rule, gated_delta_net.l2norm, mamba_mixer.mamba_chunk_scan_combined)
    mixers = [m for m in model.modules() if isinstance(m, mamba_mixer.MambaMixer)]
    norms = [m.norm for m in mixers]
    gated_delta_net.chunk_gated_delta_rule, gated_delta_net.l2norm = kernels.chunk_gated_delta_rule, kernels.l2norm
    mamba_mixer.mamba_chunk_scan_combined = kernels.mamba_chunk_scan_combined
    for mixer, norm in zip(mixers, norms):
        mixer.norm = kernels.gated_norm(norm)
    try:
        yield
    finally:
        gated_delta_net.chunk_gated_delta_rule, gated_delta_net.l2norm, mamba_mixer.mamba_chunk_scan_combined = saved
        for mixer, norm in zip(mixers, norms):
            mixer.norm = norm


def outputs(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits and each mixer's output, by module name."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.mamba_mixer import MambaMixer

    seen: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_hook(lambda _m, _i, out, name=name: seen.__setitem__(name, out[0].detach()))
             for name, module in model.named_modules() if isinstance(module, (GatedDeltaNet, MambaMixer))]
    s = tokens.shape[1]
    positions = torch.arange(s, device=tokens.device).unsqueeze(0)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1).view(1, 1, s, s)
    try:
        with torch.no_grad():
            seen["logits"] = model(tokens, positions, mask).detach()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The output that differs most, relative to its largest magnitude."""
    diffs = {name: ((a[name] - b[name]).abs().max() / a[name].abs().max()).item() for name in a}
    name = max(diffs, key=diffs.get)
    return name, diffs[name]


def enlarge(model: torch.nn.Module, seed: int) -> None:
    """Weights of unit scale (megatron-core's init is 0.02), so no kernel's term vanishes under rounding; A_log, dt_bias
    and the norms keep their init's meaning (a decaying state, softplus in range, gains near 1)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator).to(p.device)
            p.add_(noise * (0.1 if p.ndim == 1 else 1.0 / p.shape[-1] ** 0.5))


def check(preset: str, tokens_count: int, kernels: Kernels) -> bool:
    config = PRESETS[preset]
    (model,) = build_model(config, Layout())
    enlarge(model, seed=0)
    model.eval()
    tokens = torch.randint(0, config.vocab_size, (2, tokens_count), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(next(model.parameters()).device)
    reference = outputs(model, tokens)
    with calling(model, kernels):
        kernel_name, kernel_diff = worst(reference, outputs(model, tokens))
    sabotaged = dataclasses.replace(kernels, l2norm=lambda x: x) if config.experimental_attention_variant else \
        dataclasses.replace(kernels, mamba_chunk_scan_combined=lambda *a, D=None, **k: kernels.mamba_chunk_scan_combined(*a, **k))
    with calling(model, sabotaged):
        _, sabotage_diff = worst(reference, outputs(model, tokens))
    ok = kernel_diff < TOLERANCE and sabotage_diff > SABOTAGE_FLOOR
    print(f"{preset}: stand-ins vs kernels {kernel_diff:.2e} at {kernel_name} (tolerance {TOLERANCE:.0e}); "
          f"a deliberate error {sabotage_diff:.2e} (must exceed {SABOTAGE_FLOOR:.0e}): {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("kernel_check: needs a CUDA GPU (it compares the CPU stand-ins with the GPU kernels)", file=sys.stderr)
        return 2
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # Triton's fp32 dots in full fp32, as torch's
    kernels = gpu_kernels()
    init_parallel(Layout())
    results = [check(preset, count, kernels) for preset, count in CHECKED.items()]
    torch.distributed.destroy_process_group()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {sum(results)} of {len(results)} presets agree")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
