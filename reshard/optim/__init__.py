"""Megatron's DistributedOptimizer state: the parameter order of its buffers (`order`), their layout (`buffers`), each
form it is stored in, read and written (`dp_reshardable`, `distrib_optim_pt`, `flattened_range`), and the guard that
every decode of a buffer is the saving run's (`master_weights`)."""
