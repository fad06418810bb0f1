"""Experts with biases (gpt-oss's) that megatron-core 0.16.1's local spec can train.

SequentialMLP hands each expert its routing probabilities, and MLP.forward then adds the expert's fc2 bias scaled by
them in place: `output += output_bias * per_token_scale` (megatron/core/transformer/mlp.py:247). RowParallelLinear's
output is what a custom autograd Function gave back (the TP reduce, or its input as-is at TP1), and autograd refuses an
in-place change of that in a training step ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified
inplace"); a forward without gradients runs. This linear_fc2 gives back a copy, which the in-place add may change; its
values, parameters, names and sharded state are RowParallelLinear's.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear


class ExpertRowParallelLinear(RowParallelLinear):
    def forward(self, input_):
        output, bias = super().forward(input_)
        return output.clone(), bias


def use_in(layer_spec) -> None:
    """Build the MoE experts of `layer_spec` (a local-spec transformer layer) with this linear_fc2."""
    layer_spec.submodules.mlp.submodules.experts.submodules.linear_fc2 = ExpertRowParallelLinear
