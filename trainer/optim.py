"""Megatron's DDP wrapper, optimizer and LR scheduler for a list of model chunks."""

from __future__ import annotations

import functools

import torch


def build_optimizer(models: list, *, lr: float = 1e-2, min_lr: float = 0.0, weight_decay: float = 0.0,
                    adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
                    clip_grad: float = 0.0, bf16: bool = False, use_distributed_optimizer: bool = False,
                    bucket_size: int | None = None):
    """Wrap the chunks in Megatron's DistributedDataParallel and build `get_megatron_optimizer` (Adam).

    Returns (ddp_chunks, optimizer). bf16 uses Megatron's mixed-precision optimizer (fp32 master
    weights, grads reduced in fp32). `bucket_size` (elements) overlaps the gradient reduce with the backward
    pass in buckets of about that size, as Megatron-LM's --overlap-grad-reduce --ddp-bucket-size.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
        grad_reduce_in_fp32=bf16,
    )
    ddp = [
        DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
        for i, m in enumerate(models)
    ]
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay,
        adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
        use_distributed_optimizer=use_distributed_optimizer,
        bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32, clip_grad=clip_grad,
    )
    if use_distributed_optimizer:
        _let_distributed_optimizer_over_torch_adam_load()
    return ddp, get_megatron_optimizer(opt_config, ddp)


def _let_distributed_optimizer_over_torch_adam_load() -> None:
    """Let megatron-core's (0.16) DistributedOptimizer load its state when it runs torch's Adam.

    Without Transformer Engine or Apex (always on the CPU) it wraps torch's Adam, which keeps a `step`
    tensor per parameter and creates its state at the first step; FusedAdam keeps the step in the param
    groups. Megatron's checkpoint load was written for FusedAdam and fails three ways over torch's Adam:

    * `state_dict()`, which builds the load request, asserts that all parameters share one step, which an
      optimizer that has not stepped yet does not have: it gets the state torch's first step would create
      (step 0, zero moments), so the request can be built and nothing else changes;
    * `load_state_dict()` hands every parameter the same step tensor, which torch's Adam then increments
      once per parameter per step (wrong bias correction from the first resumed step): each gets its own copy;
    * `_set_main_param_and_optimizer_states()` then copies every state entry of the parameter from the
      loaded tensors, step included, which the fully_reshardable form lacks (KeyError 'step') and the
      dp_reshardable one holds as it was when the request was built (0): the step loaded from the param
      groups stays.

    With Transformer Engine or Apex (FusedAdam: no per-parameter step) nothing is patched. Idempotent.
    """
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True) or getattr(cls, "_reshard_torch_adam", False):
        return
    state_dict, load_state_dict, set_states = cls.state_dict, cls.load_state_dict, cls._set_main_param_and_optimizer_states

    @functools.wraps(state_dict)
    def state_dict_with_state(self):
        if not self.optimizer.state:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    self.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                               "exp_avg_sq": torch.zeros_like(p)}
        return state_dict(self)

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state):
        load_state_dict(self, state)
        for s in self.optimizer.state.values():
            if "step" in s:
                s["step"] = s["step"].clone()

    @functools.wraps(set_states)
    def set_loaded_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        set_states(self, model_param, {**tensors, "step": state["step"]} if "step" in state else tensors)

    cls.state_dict, cls.load_state_dict = state_dict_with_state, load_state_dict_with_own_steps
    cls._set_main_param_and_optimizer_states = set_loaded_states
    cls._reshard_torch_adam = True


def build_scheduler(optimizer, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                    global_batch_size: int, weight_decay: float = 0.0, style: str = "cosine"):
    """Megatron's OptimizerParamScheduler, counted in samples as Megatron-LM does
    (it is stepped by the global batch size each iteration)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_iters * global_batch_size,
        lr_decay_steps=max(decay_iters, 1) * global_batch_size,
        lr_decay_style=style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(decay_iters, 1) * global_batch_size,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
