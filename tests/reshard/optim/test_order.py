"""The parameter-order tables (`reshard.optim.order.LAYER_ORDERS`) are the one place a parameter's place in the
DistributedOptimizer's buffers is known: a model family's new parameter is placed by its table entry alone.

Megatron's own saves prove the tables' present entries (test_dp_reshardable.py, test_te_order.py, test_mla_order.py);
these tests need no Megatron. The example parameter is gpt-oss's attention sinks (now in the tables): megatron-core 0.16.1's
DotProductAttention registers `softmax_offset` with softmax_type="learnable" (dot_product_attention.py:127), and
Attention builds core_attention before linear_proj (attention.py:318, 349), so it comes right after the input norm."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.models import TINY_LLAMA
from reshard.architecture import model_tensors
from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.logical import Split, TensorSpec, describe
from reshard.optim.buffers import BufferLayout
from reshard.optim.order import LAYER_ORDERS, MULTI_HEAD, MULTI_LATENT, ParamOrder, parameter_of
from reshard.trainer.presets import TINY_NEMOTRON_H
from tests.converters.hf_models import build

SINKS = "self_attention.core_attention.softmax_offset"
LOCAL = ("local", MULTI_HEAD)


def _layer_spec(tail: str) -> TensorSpec:
    name = f"decoder.layers.{tail}"
    return TensorSpec(name, (2, 4), "float32", Split.NONE, stacked=True, param=name)


def _sinks_after_the_input_norm(order: tuple[str, ...]) -> tuple[str, ...]:
    at = order.index("self_attention.linear_proj.weight")
    return (*order[:at], SINKS, *order[at:])


def test_a_parameter_no_table_places_is_refused_by_name():
    unknown = "self_attention.core_attention.temperature"  # a parameter no family has (yet)
    with pytest.raises(ReshardError, match=f"decoder.layers.{unknown}: where megatron-core places this parameter"):
        ParamOrder("local").key(_layer_spec(unknown), 0, None)


@pytest.mark.parametrize("args,words", [
    ({"use_te_op_fuser": True}, "a model with Transformer-Engine's fused-op MLP"),
])
def test_a_model_whose_order_is_not_derived_is_refused_by_name(args, words):
    with pytest.raises(ReshardError, match=f"DistributedOptimizer state of {words}"):
        ParamOrder.of({"transformer_impl": "transformer_engine", **args})


def test_a_parameter_keyed_in_parts_lies_in_the_buffers_as_one():
    """torch_dist keys a Mamba mixer's conv1d bias as three tensors (its x, B, C channels); the DistributedOptimizer
    holds the one parameter: at TP2 its parts (32, 16, 16 elements) lie one after the other from one 64-element
    alignment, in the parameter's row order, while parameters each start on their own (megatron-core's own save of it:
    test_hybrid_order.py)."""
    config = TINY_NEMOTRON_H
    specs = {name: describe(name, shape, "float32", config) for name, shape in model_tensors(config).items()}
    layout = BufferLayout(specs, config, Layout(tp=2), {"transformer_impl": "transformer_engine", "data_parallel_size": 2})
    placed = {place.name: place for gbuf, place in layout.placed.values() if gbuf.group == 0}
    bias = [placed[f"decoder.layers.2.mixer.conv1d.bias.{part}"] for part in ("x", "B", "C")]
    assert [(p.start, p.numel) for p in bias] == [(bias[0].start, 32), (bias[0].start + 32, 16), (bias[0].start + 48, 16)]
    assert bias[0].start % 64 == 0 and placed["decoder.layers.2.mixer.conv1d.weight.x"].start == bias[0].start + 64
    assert all(place.start % 64 == 0 for name, place in placed.items() if parameter_of(name) == name)


def test_a_frozen_part_has_no_optimizer_state(tmp_path):
    """Bridge's freeze_vision_model freezes Qwen2.5-VL's patch embedding and blocks, not its merger (the vision
    projection) nor the language model; a part no tower names is refused by name (megatron-core's own save of a frozen
    run: test_vl_order.py)."""
    config = _vl_config("qwen2_5_vl", tmp_path / "hf")
    order = ParamOrder.of({"transformer_impl": "local", "freeze_vision_model": True}, MULTI_HEAD, config)
    assert [order.trains(n) for n in ("visual.patch_embed.proj.weight", "visual.blocks.1.attn.qkv.bias", "visual.merger.mlp.0.weight",
                                      "language_model.output_layer.weight")] == [False, False, True, True]
    assert not ParamOrder.of({"freeze_language_model": True}, MULTI_HEAD, config).trains("language_model.output_layer.weight")
    with pytest.raises(ReshardError, match="freeze_vision_model: the run froze a part the model does not name"):
        ParamOrder.of({"freeze_vision_model": True})


def _vl_config(family: str, hf_dir: Path):
    from reshard.formats import open_checkpoint

    return open_checkpoint(build(family, hf_dir)).config


def test_a_vl_models_tower_comes_before_its_language_model(tmp_path):
    """Megatron-Bridge's Qwen25VLModel registers its vision tower before its language model, each tower tensor in the
    order its family lists it (megatron-core's own save of it: test_vl_order.py, with Bridge's venv)."""
    config = _vl_config("qwen2_5_vl", tmp_path / "hf")
    order = ParamOrder.of({"transformer_impl": "local"}, MULTI_HEAD, config)
    names = ["language_model.embedding.word_embeddings.weight", "visual.merger.mlp.2.bias", "visual.patch_embed.proj.weight",
             "language_model.decoder.layers.self_attention.linear_qkv.weight", "visual.blocks.1.norm1.weight"]
    specs = [TensorSpec(n, (2, 4), "float32", Split.NONE, stacked=n.startswith("language_model.decoder."), param=n) for n in names]
    ranked = [spec.name for spec in sorted(specs, key=lambda spec: order.key(spec, 0 if spec.stacked else None, None))]
    assert ranked == ["visual.patch_embed.proj.weight", "visual.blocks.1.norm1.weight", "visual.merger.mlp.2.bias",
                      "language_model.embedding.word_embeddings.weight", "language_model.decoder.layers.self_attention.linear_qkv.weight"]


def test_a_tower_of_stacked_blocks_goes_block_by_block(tmp_path):
    """Qwen3-VL's vision model (Megatron form): a stacked block's parameters come together, in Transformer Engine's
    layer order (linear_proj before the fused norm), the blocks in turn, between the position embedding and the
    DeepStack mergers (megatron-core's own save of it: test_vl_order.py, with Bridge's venv)."""
    order = ParamOrder.of({"transformer_impl": "transformer_engine"}, MULTI_HEAD, _vl_config("qwen3_vl", tmp_path / "hf"))
    blocks, deepstack = "vision_model.decoder.layers.", "vision_model.decoder.deepstack_merger_list."
    placed = [("vision_model.merger.patch_norm.weight", None), (f"{deepstack}patch_norm.weight", 0),
              (f"{blocks}self_attention.linear_qkv.layer_norm_weight", 1), (f"{blocks}self_attention.linear_proj.weight", 1),
              (f"{blocks}mlp.linear_fc2.bias", 0), (f"{blocks}self_attention.linear_qkv.layer_norm_weight", 0),
              ("vision_model.pos_embed.weight", None), ("language_model.embedding.word_embeddings.weight", None)]
    ranked = sorted(placed, key=lambda p: order.key(TensorSpec(p[0], (2,), "float32", Split.NONE, stacked=p[1] is not None, param=p[0]),
                                                    p[1], None))
    assert ranked == [placed[6], placed[5], placed[4], placed[3], placed[2], placed[1], placed[0], placed[7]]


def test_the_sinks_have_their_entry():
    """gpt-oss's sinks, placed as below by their one entry in each table (megatron-core's own saves of them:
    test_gpt_oss_order.py)."""
    without = tuple(tail for tail in LAYER_ORDERS[LOCAL] if tail != SINKS)
    assert LAYER_ORDERS[LOCAL] == _sinks_after_the_input_norm(without)
    assert LAYER_ORDERS[("transformer_engine", MULTI_HEAD)][0] == SINKS  # TE: no input norm module, core_attention first


def test_one_table_entry_places_a_new_parameter(monkeypatch):
    monkeypatch.setitem(LAYER_ORDERS, LOCAL, _sinks_after_the_input_norm(LAYER_ORDERS[LOCAL]))
    order = ParamOrder.of({"transformer_impl": "local"})
    tails = ["self_attention.linear_proj.weight", SINKS, "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc2.weight"]
    ranked = sorted(tails, key=lambda tail: order.key(_layer_spec(tail), 0, None))
    assert ranked == ["self_attention.linear_qkv.layer_norm_weight", SINKS, "self_attention.linear_proj.weight", "mlp.linear_fc2.weight"]
    assert order.key(_layer_spec(SINKS), 1, None) > order.key(_layer_spec("mlp.linear_fc2.weight"), 0, None)  # layer by layer


def test_the_buffers_lay_out_the_new_parameter_where_its_entry_says(monkeypatch):
    """The whole derivation follows the entry: a TINY_LLAMA rank's buffer at TP2 with the sinks (one per head, split by
    heads as attention is: 2 on each rank) holds them between the input norm and linear_proj, in reverse order, each
    on its own 64-element alignment."""
    monkeypatch.setitem(LAYER_ORDERS, LOCAL, _sinks_after_the_input_norm(LAYER_ORDERS[LOCAL]))
    specs = {
        name: TensorSpec(name, shape, "float32", split, stacked=name.startswith("decoder.layers."), param=name)
        for name, shape, split in (
            ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (TINY_LLAMA.num_layers, TINY_LLAMA.hidden_size), Split.NONE),
            (f"decoder.layers.{SINKS}", (TINY_LLAMA.num_layers, 4), Split.COLUMN),
            ("decoder.final_layernorm.weight", (TINY_LLAMA.hidden_size,), Split.NONE),
        )
    }
    layout = BufferLayout(specs, TINY_LLAMA, Layout(tp=2), {"transformer_impl": "local", "data_parallel_size": 2})
    places = sorted((place.start, place.name, place.layer) for gbuf, place in layout.placed.values() if gbuf.group == 0)
    last = TINY_LLAMA.num_layers - 1
    assert [(name.rsplit(".", 2)[-2], layer) for _, name, layer in places][:3] == [
        ("final_layernorm", None), ("core_attention", last), ("linear_qkv", last)
    ]
    assert all(start % 64 == 0 for start, _, _ in places)
    assert {place.numel for _, place in layout.placed.values() if place.name.endswith(SINKS)} == {2}


def test_every_attention_and_spec_has_its_entry():
    """What selects an order is (module spec, attention); an order of a combination with no entry is refused."""
    assert set(LAYER_ORDERS) == {(spec, attention) for spec in ("local", "transformer_engine") for attention in (MULTI_HEAD, MULTI_LATENT)}
    with pytest.raises(ReshardError, match="transformer_impl=inference_optimized model with multi-head attention is not decoded"):
        ParamOrder.of({"transformer_impl": "inference_optimized"})
