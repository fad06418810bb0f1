"""Let megatron-core (0.16) run on a machine without CUDA.

A handful of megatron-core modules call CUDA unconditionally (found by running megatron-core 0.16.1
with gloo on a CPU-only torch). `apply()` redirects exactly those calls:

* In the modules of `_CUDA_MODULES` the module-global name `torch` is replaced by a thin proxy
  (`_CpuTorch`) that forwards everything to the real `torch` except that
  - `torch.cuda.current_device()` answers `cpu`, `synchronize`/`empty_cache` do nothing,
    `Stream`/`stream`/`current_stream`/`default_stream` give inert stand-ins;
  - tensor factories (`zeros`, `ones`, `empty`, ...) asked for `device="cuda"` allocate on the CPU.
  This covers GlobalMemoryBuffer (core/utils.py), TP gathers (tensor_parallel/mappings.py), sequence parallel's
  reduce-scatter buffer in the linear layers' backward (tensor_parallel/layers.py), the pipeline schedules and p2p communication,
  filesystem_async's synchronize and the torch_dist saver's result all-reduce, RoPE's and the MoE
  router's first-use move of CPU tensors to the GPU, MoE dispatcher/shared-expert streams, the
  default causal mask, the DDP grad buffers and non-distributed optimizer of an Adam step, and the
  DistributedOptimizer's gather of its shards for a `fully_reshardable` save, the MTP loss tracker of a
  training step with multi-token-prediction layers, and attention sinks' `softmax_offset` (gpt-oss).
* `tensor_parallel.random.CudaRNGStatesTracker` is replaced by a subclass that keeps CPU RNG
  states, so `model_parallel_cuda_manual_seed()` and `get_cuda_rng_tracker().fork()` work.
* `LanguageModule.setup_embeddings_and_output_layer` (tied embeddings with PP>1) calls
  `weight.data.cuda()`; on the CPU it runs with `Tensor.cuda` answering the tensor itself.
* `DistributedOptimizer.get_parameter_state_dp_zero` (the gather behind a `fully_reshardable` save)
  moves its shards with `.cuda()`; it runs with `Tensor.cuda` answering the tensor itself.
* `transformer.moe.moe_utils.te_general_gemm` is defined as None when Transformer Engine is absent (on a GPU too).
* `Float16OptimizerWithFloat16Params.__init__` (bf16/fp16 mixed precision) and the DistributedOptimizer's
  param-group building accept only `param.type()` names `torch.cuda.*Tensor`; they run with
  `Tensor.type()` answering the CUDA name for CPU tensors (only inside those calls).
* `optimizer.clip_grads.clip_grad_by_total_norm_fp32` asserts `grad.type() == 'torch.cuda.FloatTensor'`;
  on the CPU the same clipping runs with the assertion asking for float32 grads instead.

Multi-latent attention with the local spec (not a CUDA matter, so not part of `apply()`):
`local_mla_core_attention()` gives the core attention to build it with. MLA passes `k_channels`/`v_channels`
to its core attention, which only Transformer Engine's accepts; and without Transformer Engine installed
`multi_latent_attention` still believes it present (its import finds a stand-in), so its `HAVE_TE` is set False.

Nothing else is done when `torch.cuda.is_available()`; calling `apply()` again is harmless. Call it before
building models (before the first `get_cuda_rng_tracker()` / `model_parallel_cuda_manual_seed()`).
Every patch is guarded: a module or attribute that a newer megatron-core lacks is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

_CUDA_MODULES = (
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.dot_product_attention",  # attention sinks' softmax_offset
    "megatron.core.ssm.gated_delta_net",  # Qwen3-Next's linear attention (its parameters made on the current device)
    "megatron.core.ssm.mamba_mixer",  # Nemotron-H's Mamba mixer, alike (importable once `trainer.mamba` stubs its triton import)
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "zeros_like", "empty_like", "ones_like")

_applied: list[str] = []  # what apply() patched, for inspection and tests


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return None

    def synchronize(self):
        pass


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


class _CpuCuda(types.SimpleNamespace):
    """`torch.cuda` as seen by a patched module; anything not overridden comes from torch.cuda."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args, **kwargs):
        pass

    @staticmethod
    def empty_cache():
        pass

    Stream = _NullStream

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*args, **kwargs):
        return _NullStream()

    default_stream = current_stream


class _CpuTorch(types.ModuleType):
    """The `torch` module with CUDA devices mapped to the CPU (see the module docstring)."""

    cuda = _CpuCuda()

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, _f=value, **kwargs):
                if _is_cuda(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                return _f(*args, **kwargs)
            return factory
        return value


_TORCH_PROXY = _CpuTorch()


def _cpu_rng_tracker_class(base):
    class CpuRNGStatesTracker(base):
        """CudaRNGStatesTracker that keeps named CPU generator states instead of CUDA ones."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    CpuRNGStatesTracker.__qualname__ = CpuRNGStatesTracker.__name__
    return CpuRNGStatesTracker


def _with_tensor_cuda_as_identity(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    wrapper._reshard_cpu = True
    return wrapper


def _with_cuda_type_names(method, is_classmethod: bool = False):
    """Run `method` with `Tensor.type()` (no arguments) spelling CPU tensor types the CUDA way."""
    func = method.__func__ if is_classmethod else method

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.type

        def type_(self, *a, **k):
            name = original(self, *a, **k)
            # nested wrapped calls (DistributedOptimizer.__init__ calls its wrapped param-group builder) see
            # a name already spelled the CUDA way
            if a or k or self.is_cuda or not isinstance(name, str) or name.startswith("torch.cuda."):
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = type_
        try:
            return func(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    wrapper._reshard_cpu = True
    return classmethod(wrapper) if is_classmethod else wrapper


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip_grad_by_total_norm_fp32 without its CUDA-type assertion (grads scaled in place)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            if hasattr(grad, "to_local"):
                grad = grad.to_local()
            assert grad.dtype in ((torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,))
            grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


_clip_grad_by_total_norm_fp32_cpu._reshard_cpu = True


def _define_te_general_gemm() -> None:
    """megatron-core's MoE router reads `te_general_gemm`, which its module defines only when Transformer Engine
    imports: without TE the router fails on a GPU as on the CPU (found by `kernel_check` on an H200)."""
    moe_utils = _import("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _applied.append("megatron.core.transformer.moe.moe_utils.te_general_gemm")


def apply() -> list[str]:
    """Redirect megatron-core's CUDA-only calls to the CPU when CUDA is unavailable.

    Returns the names of what is patched (on a CUDA machine, at most the TE-less router's gemm). Idempotent.
    """
    _define_te_general_gemm()
    if torch.cuda.is_available():
        return list(_applied)
    for name in _CUDA_MODULES:
        module = _import(name)
        if module is not None and getattr(module, "torch", None) is torch:
            module.torch = _TORCH_PROXY
            _applied.append(name)

    random = _import("megatron.core.tensor_parallel.random")
    base = getattr(random, "CudaRNGStatesTracker", None)
    if base is not None and not getattr(base, "_reshard_cpu", False):
        tracker = _cpu_rng_tracker_class(base)
        tracker._reshard_cpu = True
        random.CudaRNGStatesTracker = tracker
        # A tracker made before apply() holds CUDA states: have the next use rebuild it.
        if getattr(random, "_CUDA_RNG_STATE_TRACKER", None) is not None:
            random._CUDA_RNG_STATE_TRACKER = None
            random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        _applied.append("megatron.core.tensor_parallel.random.CudaRNGStatesTracker")

    language_module = _import("megatron.core.models.common.language_module.language_module")
    cls = getattr(language_module, "LanguageModule", None)
    setup = getattr(cls, "setup_embeddings_and_output_layer", None)
    if setup is not None and not getattr(setup, "_reshard_cpu", False):
        cls.setup_embeddings_and_output_layer = _with_tensor_cuda_as_identity(setup)
        _applied.append("megatron.core.models.common.language_module.LanguageModule.setup_embeddings_and_output_layer")

    optimizer = _import("megatron.core.optimizer.optimizer")
    cls = getattr(optimizer, "Float16OptimizerWithFloat16Params", None)
    if cls is not None and not getattr(cls.__init__, "_reshard_cpu", False):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
        _applied.append("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__")
    distrib = _import("megatron.core.optimizer.distrib_optimizer")
    cls = getattr(distrib, "DistributedOptimizer", None)
    for attr in ("_build_model_and_main_param_groups", "__init__"):
        method = cls.__dict__.get(attr) if cls is not None else None
        if method is not None and not getattr(getattr(method, "__func__", method), "_reshard_cpu", False):
            setattr(cls, attr, _with_cuda_type_names(method, isinstance(method, classmethod)))
            _applied.append(f"megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.{attr}")
    gather = cls.__dict__.get("get_parameter_state_dp_zero") if cls is not None else None
    if gather is not None and not getattr(gather, "_reshard_cpu", False):
        cls.get_parameter_state_dp_zero = _with_tensor_cuda_as_identity(gather)
        _applied.append("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero")
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = _import(name)
        clip = getattr(module, "clip_grad_by_total_norm_fp32", None)
        if clip is not None and not getattr(clip, "_reshard_cpu", False):
            module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
            _applied.append(f"{name}.clip_grad_by_total_norm_fp32")
    return list(_applied)


def local_mla_core_attention():
    """Megatron-Core's local DotProductAttention, as multi-latent attention can build it (see the module
    docstring): it drops the per-head key/value widths, which it takes from the config (kv_channels must
    be the value head dim; query and key widths need no setting in its matmuls)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if _import("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False

    class LocalMLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return LocalMLADotProductAttention
