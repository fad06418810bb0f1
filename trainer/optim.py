"""Megatron's DDP wrapper, optimizer and LR scheduler for a list of model chunks."""

from __future__ import annotations

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
    return ddp, get_megatron_optimizer(opt_config, ddp)


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
