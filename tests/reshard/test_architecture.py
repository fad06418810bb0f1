"""Layers of different kinds in one model (Gated DeltaNet or attention, MoE or dense): the tensors each layer has,
how each is cut, and a model of mixed layers through every layout and form reshard carries it in."""

from __future__ import annotations

import pytest

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import SyntheticReader, write_synthetic
from reshard.architecture import check_shapes, model_tensors
from reshard.config import LayerKind
from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.inspect import inspect
from reshard.layout import Layout
from reshard.logical import Split, describe
from reshard.naming import default_extra_state
from reshard.request import Target
from reshard.sharding import full_region, pieces
from reshard.verify import verify
from tests.arrays import same, tensors

GDN = dict(experimental_attention_variant="gated_delta_net", linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
# Gated DeltaNet on layers 0 and 2, attention on 1 and 3 (Megatron-Core's linear_attention_freq 2); layer 0's MLP
# dense, the others MoE: four layers, three kinds, and a two-stage cut between layers 1 and 2 changes the mixer.
HYBRID = TINY_MOE.replace(linear_attention_freq=2, moe_layer_freq=(0, 1, 1, 1), **GDN)
ATTN = "decoder.layers.{}.self_attention."


def test_layer_kinds_read_megatron_cores_patterns():
    assert HYBRID.layer_kinds == [LayerKind("gated_delta_net", False), LayerKind("attention", True),
                                  LayerKind("gated_delta_net", True), LayerKind("attention", True)]
    # an int N: N-1 linear-attention layers, then one of attention (get_linear_attention_pattern)
    assert TINY_LLAMA.replace(num_layers=8, linear_attention_freq=4, **GDN).linear_attention_layers == [True] * 3 + [False] + [True] * 3 + [False]
    assert TINY_LLAMA.replace(linear_attention_freq=[0, 1, 1, 0], **GDN).linear_attention_layers == [False, True, True, False]
    assert TINY_LLAMA.layer_kinds == [LayerKind()] * 4  # no variant: attention everywhere, whatever the frequency says


@pytest.mark.parametrize("changes, field", [
    ({"linear_attention_freq": (1, 0)}, "linear_attention_freq"),
    ({"linear_attention_freq": (1, 2, 1, 0)}, "linear_attention_freq"),
    ({"linear_attention_freq": None}, "linear_attention_freq"),
    ({"experimental_attention_variant": "dsa"}, "experimental_attention_variant"),
])
def test_a_pattern_megatron_core_would_not_build_is_refused_by_name(changes, field):
    with pytest.raises(ReshardError, match=field):
        model_tensors(HYBRID.replace(**changes))


def test_megatron_core_keys_layers_apart_where_kinds_mix_and_stacks_them_where_they_do_not():
    """TransformerBlock.sharded_state_dict: non-homogeneous layers for a linear_attention_freq above 1 or a list."""
    assert HYBRID.per_layer_names
    assert TINY_LLAMA.replace(linear_attention_freq=2, **GDN).per_layer_names  # dense, mixers mixed
    every = TINY_LLAMA.replace(linear_attention_freq=[1, 1, 1, 1], **GDN)  # a list: apart, though all alike
    assert every.per_layer_names
    assert all(every.linear_attention_layers)
    one = TINY_LLAMA.replace(linear_attention_freq=1, **GDN)  # every layer its group's attention layer: all alike
    assert not one.per_layer_names and model_tensors(one) == model_tensors(TINY_LLAMA)


def test_each_layer_has_its_kinds_tensors_and_no_others():
    shapes = model_tensors(HYBRID)
    layer = {i: {n.removeprefix(f"decoder.layers.{i}."): s for n, s in shapes.items() if n.startswith(f"decoder.layers.{i}.")}
             for i in range(4)}
    gdn = {"self_attention.in_proj.layer_norm_weight": (64,),
           "self_attention.in_proj.weight.query": (32, 64), "self_attention.in_proj.weight.key": (32, 64),
           "self_attention.in_proj.weight.value": (32, 64), "self_attention.in_proj.weight.z": (32, 64),
           "self_attention.in_proj.weight.beta": (4, 64), "self_attention.in_proj.weight.alpha": (4, 64),
           "self_attention.conv1d.weight.query": (32, 1, 4), "self_attention.conv1d.weight.key": (32, 1, 4),
           "self_attention.conv1d.weight.value": (32, 1, 4),
           "self_attention.A_log": (4,), "self_attention.dt_bias": (4,),
           "self_attention.out_norm.weight": (8,), "self_attention.out_proj.weight": (64, 32)}
    attention = {"self_attention.linear_qkv.layer_norm_weight": (64,), "self_attention.linear_qkv.weight": (128, 64),
                 "self_attention.linear_proj.weight": (64, 64)}
    dense = {"mlp.linear_fc1.layer_norm_weight": (64,), "mlp.linear_fc1.weight": (256, 64), "mlp.linear_fc2.weight": (64, 128)}
    moe = {"pre_mlp_layernorm.weight": (64,), "mlp.router.weight": (4, 64),
           "mlp.experts.experts.linear_fc1.weight": (4, 128, 64), "mlp.experts.experts.linear_fc2.weight": (4, 64, 64)}
    assert layer == {0: gdn | dense, 1: attention | moe, 2: gdn | moe, 3: attention | moe}
    assert not any(n.startswith("decoder.layers.") and n.split(".")[2].isalpha() for n in shapes)  # nothing stacked


def test_gated_delta_net_tensors_split_over_tp_as_megatron_core_shards_them():
    """GatedDeltaNet.sharded_state_dict: A_log and dt_bias on axis 0, the convolution's channels on axis 0, the input
    projection column-parallel (its six parts each), the output projection row-parallel, the norms whole."""
    splits = {name.removeprefix(ATTN.format(2)): describe(name, shape, "float32", HYBRID).split
              for name, shape in model_tensors(HYBRID).items() if name.startswith(ATTN.format(2))}
    assert splits == {**{f"in_proj.weight.{p}": Split.COLUMN for p in ("query", "key", "value", "z", "beta", "alpha")},
                      **{f"conv1d.weight.{p}": Split.COLUMN for p in ("query", "key", "value")},
                      "A_log": Split.COLUMN, "dt_bias": Split.COLUMN, "out_proj.weight": Split.ROW,
                      "in_proj.layer_norm_weight": Split.NONE, "out_norm.weight": Split.NONE}


def test_a_two_stage_cut_between_kinds_puts_each_layer_on_its_stage():
    layout = Layout(tp=2, pp=2)
    name = ATTN.format(2) + "in_proj.weight.value"
    spec = describe(name, model_tensors(HYBRID)[name], "float32", HYBRID)
    cut = [(p.rank.pp, p.rank.tp, p.local_layer, p.region) for p in pieces(spec, HYBRID, layout)]
    assert cut == [(1, 0, 0, ((0, 16), (0, 64))), (1, 1, 0, ((16, 32), (0, 64)))]  # the second stage's first layer, value heads halved


def test_only_a_gated_delta_net_layers_linears_carry_extra_state_and_only_attention_has_core_attentions():
    keys = default_extra_state(HYBRID, te=True)
    assert "decoder.layers.0.self_attention.in_proj._extra_state/shard_0_1" in keys
    assert "decoder.layers.0.self_attention.out_proj._extra_state/shard_0_1" in keys
    assert not any(k.startswith("decoder.layers.0.self_attention.core_attention") for k in keys)
    assert "decoder.layers.1.self_attention.core_attention._extra_state/shard_0_1" in keys
    assert not any(k.startswith("decoder.layers.1.self_attention.in_proj") for k in keys)


def test_a_shape_that_contradicts_the_linear_attention_sizes_names_them():
    with pytest.raises(ReshardError, match="linear_num_value_heads, linear_value_head_dim"):
        check_shapes(HYBRID, {ATTN.format(0) + "out_proj.weight": (64, 48)}, "ckpt")
    with pytest.raises(ReshardError, match="linear_conv_kernel_dim"):
        check_shapes(HYBRID, {ATTN.format(2) + "conv1d.weight.key": (32, 1, 3)}, "ckpt")
    with pytest.raises(ReshardError, match=r"\(check linear_num_value_heads\)"):
        check_shapes(HYBRID, {ATTN.format(0) + "A_log": (8,)}, "ckpt")


def test_mixed_layers_go_through_layouts_and_forms_bit_identical_and_verify(tmp_path):
    write_synthetic(tmp_path / "a", HYBRID, Layout(tp=2), "torch_dist")
    convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(tp=1, pp=2)))  # a stage boundary between mixers
    # per-rank files: a Gated DeltaNet's in_proj and conv1d one tensor per rank, that rank's share of each part in turn
    convert(tmp_path / "b", tmp_path / "leg", Target(format="legacy", layout=Layout(tp=2, pp=2)))
    convert(tmp_path / "leg", tmp_path / "c.zarr", Target(format="zarr", layout=Layout(pp=4)))
    convert(tmp_path / "c.zarr", tmp_path / "d", Target(format="torch_dist", layout=Layout(tp=2, pp=2, ep=2)))
    source = SyntheticReader(HYBRID)
    final = tensors(tmp_path / "d")
    assert set(final) == set(source.specs)
    assert all(same(final[name], source.read(name, full_region(spec.shape))) for name, spec in source.specs.items())
    assert verify(tmp_path / "d").comparison.ok
    assert verify(tmp_path / "d", against=tmp_path / "a").comparison.ok
    assert verify(tmp_path / "leg").comparison.ok
    info = inspect(tmp_path / "b")
    rows = {row.name: row for row in info.tensors}
    assert rows[ATTN.format(0) + "conv1d.weight.query"].shape == (32, 1, 4)
    assert rows[ATTN.format(0) + "A_log"].split == "column"
    assert info.config["linear_attention_freq"] == 2 and info.config["experimental_attention_variant"] == "gated_delta_net"


def test_layouts_a_gated_delta_net_cannot_take_are_refused_by_name(tmp_path):
    write_synthetic(tmp_path / "one", HYBRID.replace(linear_num_key_heads=1), Layout(), "torch_dist")
    with pytest.raises(ReshardError, match="linear_num_key_heads"):
        convert(tmp_path / "one", tmp_path / "tp2", Target(layout=Layout(tp=2)))
    assert not (tmp_path / "tp2").exists()
