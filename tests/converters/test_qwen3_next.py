"""Qwen3-Next's config translation and transforms: in_proj's parts as transformers' own Gated DeltaNet splits them,
the output gate's rows grouped per query group and back, the zero-centred output norm exact both ways, layer_types
<-> megatron-core's linear_attention_freq, a Megatron model of its kind exported as Qwen3-Next, and configs that say
what this mapping does not carry refused naming the field with nothing written. The logits proof is test_hf_logits.py's
(with its sabotage cases); the round trip test_hf_roundtrip.py's; the layer kinds tests/reshard/test_architecture.py's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_hf_roundtrip import cli, hf_tensors
from test_qwen2_5_vl import dist_tensors

from reshard.config import ModelConfig
from reshard.converters import families_for_model, family_for_hf, family_for_model
from reshard.converters.base import Rename
from reshard.converters.qwen3_next import (
    Qwen3Next,
    ZeroCentredNorm,
    conv_rows,
    group_gated_qkv,
    in_proj_rows,
    linear_attention_from_hf,
    split_gated_qkv,
    zero_centred,
)
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.formats.model_args import RUN_CONFIG, save_run_config
from reshard.layout import Layout
from tests.cli import refused_cli, refused_config

from hf_models import _configs, build, edited_copy

L, F = "linear_attention", "full_attention"


@pytest.fixture(scope="module")
def hf_config():
    return _configs()["qwen3_next"]


@pytest.fixture(scope="module")
def config(hf_config) -> ModelConfig:
    return family_for_hf(hf_config.to_dict()).config_from_hf(hf_config.to_dict())[0]


def test_in_proj_parts_are_the_rows_transformers_gated_delta_net_splits_them_into(hf_config, config):
    """transformers' own fix_query_key_value_ordering, fed each row's index as its value, says which rows of
    in_proj_qkvz / in_proj_ba are which head's q, k, v, z, b, a: Megatron-Core's parts take them head by head."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    module = Qwen3NextGatedDeltaNet(hf_config, layer_idx=0)
    qkvz, ba = (torch.arange(n, dtype=torch.float64)[None, None] for n in (module.in_proj_qkvz.out_features, module.in_proj_ba.out_features))
    parts = dict(zip(("query", "key", "value", "z", "beta", "alpha"), module.fix_query_key_value_ordering(qkvz, ba)))
    rows = in_proj_rows(config)
    for part, split in parts.items():
        hf, taken = rows[part]
        assert hf == ("in_proj_ba" if part in ("beta", "alpha") else "in_proj_qkvz")
        assert taken == split.flatten().long().tolist(), part
    assert sorted(r for hf, taken in rows.values() if hf == "in_proj_qkvz" for r in taken) == list(range(module.in_proj_qkvz.out_features))
    assert conv_rows(config) == {"query": list(range(32)), "key": list(range(32, 64)), "value": list(range(64, 96))}


def test_the_output_gate_rows_are_grouped_per_query_group_and_back():
    """q_proj rows per head [q_h; g_h] -> Megatron-Core's per group [queries; gates; k; v] (2 groups of 2 heads)."""
    heads, groups, hd = 4, 2, 1
    q_gate = np.array([f"{kind}{h}" for h in range(heads) for kind in "qg"])
    k, v = np.array(["k0", "k1"]), np.array(["v0", "v1"])
    grouped = group_gated_qkv(q_gate, k, v, heads, groups, hd)
    assert list(grouped) == ["q0", "q1", "g0", "g1", "k0", "v0", "q2", "q3", "g2", "g3", "k1", "v1"]
    back = split_gated_qkv(grouped, heads, groups, hd)
    assert [list(t) for t in back] == [list(q_gate), list(k), list(v)]
    with pytest.raises(ReshardError, match="q_proj"):
        group_gated_qkv(q_gate[:6], k, v, heads, groups, hd)


def test_the_output_norm_is_stored_less_one_exactly_and_a_weight_it_cannot_hold_so_is_refused():
    weight = np.float32(1) + np.random.default_rng(0).normal(0, 0.3, 64).astype(np.float32)
    assert np.array_equal(zero_centred(weight, "norm") + np.float32(1), weight)
    with pytest.raises(ReshardError, match="layers.0.linear_attn.norm.weight: a norm weight below 0.5"):
        zero_centred(np.array([0.1], np.float32), "layers.0.linear_attn.norm.weight")


@pytest.mark.parametrize("kinds,freq", [
    ([L, F] * 2, 2),
    ([L, L, L, F] * 2, 4),  # Qwen3-Next-80B's interval
    ([F, L, L, F], (0, 1, 1, 0)),  # no period megatron-core's int says: a 0/1 per layer
    ([L, L], (1, 1)),
])
def test_layer_types_are_megatron_cores_linear_attention_freq_and_back(config, kinds, freq):
    hf = {"num_hidden_layers": len(kinds), "layer_types": kinds}
    fields = linear_attention_from_hf(hf)
    assert fields["linear_attention_freq"] == freq and fields["experimental_attention_variant"] == "gated_delta_net"
    model = config.replace(num_layers=len(kinds), moe_layer_freq=1, **fields)
    assert ["linear_attention" if linear else "full_attention" for linear in model.linear_attention_layers] == kinds
    release = {"num_hidden_layers": 8, "full_attention_interval": 4}  # the release's spelling, without layer_types
    assert linear_attention_from_hf(release)["linear_attention_freq"] == 4


def test_no_bridge_run_config_is_written_for_its_layers(config, tmp_path):
    """Bridge's providers describe softmax attention only: one in run_config.yaml would build another model than these
    tensors', so a hybrid's torch_dist output has none (an attention-only model of the same widths gets one)."""
    save_run_config(tmp_path, {}, config, Layout(), te_names=True)
    assert not (tmp_path / RUN_CONFIG).exists()
    attention_only = config.replace(experimental_attention_variant=None, linear_attention_freq=None)
    save_run_config(tmp_path, {}, attention_only, Layout(), te_names=True)
    assert (tmp_path / RUN_CONFIG).is_file()


def test_a_megatron_model_of_its_kind_exports_as_qwen3_next_and_no_other(config):
    # Qwen3.5-MoE's Megatron model is Qwen3-Next's (they differ in HF names only): the default export stays Qwen3-Next
    assert [family.model_type for family in families_for_model(config)] == ["qwen3_next", "qwen3_5_moe_text"]
    for differs in ({"attention_output_gate": False}, {"layernorm_zero_centered_gamma": False}, {"moe_shared_expert_gate": False}):
        assert families_for_model(config.replace(**differs)) == [], differs
    qwen2_moe_like = config.replace(experimental_attention_variant=None, linear_attention_freq=None, attention_output_gate=False,
                                    layernorm_zero_centered_gamma=False, qk_layernorm=False, add_qkv_bias=True, rotary_percent=1.0)
    assert [family.model_type for family in families_for_model(qwen2_moe_like)] == ["qwen2_moe"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "hf")


@pytest.mark.parametrize("change,words", [
    ({"layer_types": [L, "sliding_attention", L, F]}, ("layer_types 'sliding_attention'",)),
    ({"layer_types": [L, F]}, ("layer_types", "4 layers")),
    ({"linear_num_value_heads": 3}, ("linear_num_value_heads=3", "a multiple of linear_num_key_heads=2")),
    ({"mtp_num_hidden_layers": 2}, ("mtp_num_hidden_layers", "0 or 1", "one mtp.fc")),
    ({"mtp_num_hidden_layers": 1, "layer_types": [F, L, F, L]}, ("mtp_num_hidden_layers=1 after a last layer of linear attention",)),
    ({"num_experts": 0}, ("num_experts=0",)),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3}},
     ("partial_rotary_factor",)),
])
def test_what_the_mapping_does_not_carry_is_refused_by_name(source, tmp_path, monkeypatch, capsys, change, words):
    refused_config(monkeypatch, capsys, source, tmp_path, change, *words)


def test_qwen3_5s_split_in_proj_is_the_convolutions_channel_order_and_its_z_b_a_as_they_are():
    """Qwen3.5 (converters/qwen3_5.py) projects [q; k; v] flat (then convolved in that order), z, b and a apart."""
    from reshard.converters.qwen3_5 import split_in_proj

    hf = dict(_configs()["qwen3_5"].to_dict())
    config = family_for_hf(hf).config_from_hf(hf)[0]
    table = {m.megatron.rsplit(".", 1)[1]: m.hf for m in split_in_proj(config)}
    assert [int(name.split("[")[1][:-1]) for name in table["query"] + table["key"] + table["value"]] == list(range(96))
    assert {part: names for part, names in table.items() if part in ("z", "beta", "alpha")} == {
        "z": ("model.layers.{layer}.linear_attn.in_proj_z.weight",), "beta": ("model.layers.{layer}.linear_attn.in_proj_b.weight",),
        "alpha": ("model.layers.{layer}.linear_attn.in_proj_a.weight",)}
    assert [family.model_type for family in families_for_model(config)] == ["qwen3_5_text"]
    with pytest.raises(ReshardError, match="num_experts=4 in a Qwen3.5 text model"):
        family_for_hf(hf).config_from_hf(dict(hf, num_experts=4))


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return build("qwen3_5_moe", tmp_path_factory.mktemp("qwen3_5_moe") / "hf")


@pytest.mark.parametrize("change,words", [
    ({"mlp_only_layers": [1]}, ("mlp_only_layers in a Qwen3.5-MoE config", "every layer MoE")),
    ({"norm_topk_prob": False}, ("norm_topk_prob", "renormalises")),
    ({"mtp_num_hidden_layers": 2}, ("mtp_num_hidden_layers", "0 or 1")),
])
def test_qwen3_5_moe_refuses_what_transformers_would_not_compute(qwen3_5_moe, tmp_path, monkeypatch, capsys, change, words):
    """Qwen3.5-MoE (converters/qwen3_5_moe.py): settings its transformers model ignores, and MTP layers but one, by name."""
    refused_config(monkeypatch, capsys, qwen3_5_moe, tmp_path, change, *words)


def test_a_megatron_model_of_qwen3_5_moes_kind_exports_as_it_where_imported_from_it():
    """Qwen3.5-MoE holds its model, as Qwen3-Next does (the same Megatron model: the one imported is exported, by
    hf_model_type); with a dense layer, HF Qwen3.5-MoE cannot hold it: refused."""
    hf = dict(_configs()["qwen3_5_moe"].to_dict())
    config = family_for_hf(hf).config_from_hf(hf)[0]
    assert [family.model_type for family in families_for_model(config)] == ["qwen3_next", "qwen3_5_moe_text"]
    assert family_for_model(config, {"hf_model_type": "qwen3_5_moe_text"}).model_type == "qwen3_5_moe_text"
    with pytest.raises(ReshardError, match=r"layers \[1\] have dense MLPs"):
        family_for_hf(hf).config_to_hf(config.replace(moe_layer_freq=(1, 0, 1, 1)))


def bridges_own_import(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """Megatron-Bridge 0.6.2's own import of the tiny HF model `name` (`tests.bridge.hybrid_imports`) equals reshard's
    torch_dist `--for bridge` of it tensor for tensor, each name, shape and value that differs named; Bridge, loading
    reshard's checkpoint with megatron-core's loader, exports the original HF weights bit for bit. reshard's tensors."""
    ours, theirs = dist_tensors(folder / name / "m" / "iter_0000000"), dist_tensors(folder / name / "bridge" / "ckpt" / "iter_0000000")
    assert (sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())) == ([], [])
    assert {k: (tuple(ours[k].shape), tuple(theirs[k].shape)) for k in ours if ours[k].shape != theirs[k].shape} == {}
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    original, exported = hf_tensors(folder / name / "hf"), load_file(folder / name / "bridge" / "export.safetensors")
    assert exported.keys() == original.keys() and [k for k in original if not torch.equal(original[k], exported[k])] == []
    return ours


@pytest.mark.slow
def test_reshards_checkpoint_is_bridges_own_import_and_bridge_exports_it_back(bridge_hybrids):
    """fixtures/bridge_hybrid.py: Bridge's Qwen3NextBridge on megatron-core 0.19.2's GPTModel (the Gated DeltaNet's in_proj
    and conv1d parts, the zero-centred output norm, the gated q/k/v, experts and the gated shared expert), on Qwen3-Next
    with every MLP MoE as released: Bridge 0.6.2 reads no mlp_only_layers (on a dense layer 0 it builds an MoE layer,
    warns that its experts are not in the HF model and saves them unset)."""
    ours = bridges_own_import(bridge_hybrids, "qwen3_next_all_moe")
    assert {"decoder.layers.0.self_attention.in_proj.weight.beta", "decoder.layers.0.self_attention.conv1d.weight.value",
            "decoder.layers.0.self_attention.out_norm.weight", "decoder.layers.1.mlp.shared_experts.gate_weight"} <= ours.keys()


@pytest.mark.slow
def test_the_comparison_with_bridges_import_fails_on_a_plain_output_norm(bridge_hybrids, tmp_path, monkeypatch):
    """The same comparison can fail: reshard's import with the Gated DeltaNet's output norm copied as it is (not made
    zero-centred, as Bridge's RMSNorm2ZeroCenteredRMSNormMapping makes it) differs from Bridge's in exactly those norms."""
    right = Qwen3Next.mappings

    def plain(self, config):
        return [Rename(m.megatron, *m.hf) if isinstance(m, ZeroCentredNorm) else m for m in right(self, config)]

    monkeypatch.setattr(Qwen3Next, "mappings", plain)
    cli("convert", bridge_hybrids / "qwen3_next_all_moe" / "hf", tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "-q")
    ours = dist_tensors(tmp_path / "m" / "iter_0000000")
    theirs = dist_tensors(bridge_hybrids / "qwen3_next_all_moe" / "bridge" / "ckpt" / "iter_0000000")
    assert sorted(k for k in ours if not torch.equal(ours[k], theirs[k])) == [
        f"decoder.layers.{i}.self_attention.out_norm.weight" for i in (0, 2)]


# --------------------------------------------------------------------------------------------------
# The release's MTP layer (`mtp.*`; converters/mtp.py's release_mtp_layer)
# --------------------------------------------------------------------------------------------------

MTP_HF = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
          "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight"}


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """The tiny model of each name with the release's MTP layer, built when first asked for."""
    root = tmp_path_factory.mktemp("mtp")
    return lambda name: root / name if (root / name).is_dir() else build(name, root / name)


@pytest.mark.parametrize("name,layout", [
    pytest.param("qwen3_next_mtp", dict(tp=2), marks=pytest.mark.fast),
    pytest.param("qwen3_next_mtp", dict(pp=2, ep=2), marks=pytest.mark.slow),  # the MTP layer on the last stage
    pytest.param("qwen3_5_mtp", dict(tp=2), marks=pytest.mark.slow),
    pytest.param("qwen3_5_moe_mtp", dict(pp=2), marks=pytest.mark.slow),
])
def test_the_releases_mtp_layer_round_trips_bit_identical(with_mtp, tmp_path, name, layout):
    """HF (with the release's mtp.*) -> torch_dist -> HF: every tensor bit for bit, mtp.* included, mtp_num_hidden_layers
    kept; megatron-core's names as Bridge's qwen3_next_bridge / qwen35_bridge tables give them."""
    source = with_mtp(name)
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", *(f"--to-{k}={v}" for k, v in layout.items()), "-q")
    with open_checkpoint(tmp_path / "m") as reader:
        assert reader.config.mtp_num_layers == 1 and reader.layout.pp == layout.get("pp", 1)
        mtp = {k for k in reader.specs if k.startswith("mtp.")}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
            "mtp.layers.0.transformer_layer.self_attention.q_layernorm.weight"} <= mtp
    assert not any("in_proj" in k for k in mtp)  # a full attention layer
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert MTP_HF <= original.keys() and exported.keys() == original.keys()
    assert [k for k in original if not torch.equal(original[k], exported[k])] == []
    assert json.loads((tmp_path / "back" / "config.json").read_text())["mtp_num_hidden_layers"] == 1


@pytest.mark.slow
def test_as_transformers_saves_it_the_mtp_layer_is_not_carried_and_a_partial_one_is_refused(with_mtp, tmp_path, monkeypatch, capsys):
    """transformers saves no mtp.* but keeps mtp_num_hidden_layers: converted without the layer, said on the output line,
    exported with mtp_num_hidden_layers 0. Files holding part of it: refused naming the first missing tensor."""
    saved = edited_copy(with_mtp("qwen3_next_mtp"), tmp_path / "saved", lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")])
    said = cli("convert", saved, tmp_path / "m", "--to-format", "torch_dist")
    assert "not carried: 1 x MTP layers (1 named by mtp_num_hidden_layers, none in the files)" in said, said
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["mtp_num_hidden_layers"] == 0
    partial = edited_copy(with_mtp("qwen3_next_mtp"), tmp_path / "partial", lambda t: t.pop("mtp.pre_fc_norm_hidden.weight"))
    refused_cli(monkeypatch, capsys, ["convert", partial, tmp_path / "out", "--to-format", "torch_dist", "-q"],
                "tensor mtp.pre_fc_norm_hidden.weight is missing", "mtp_num_hidden_layers", untouched=(partial,))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_reshards_mtp_layer_is_bridges_own_import_and_bridge_exports_it_back(bridge_hybrids):
    """Bridge 0.6.2's Qwen3NextBridge imports the release's mtp.* (megatron-core 0.19.2 keys its mtp_model_layer as
    transformer_layer in torch_dist, as 0.16.1 does): reshard's `--for bridge` holds the same tensors, and Bridge exports
    reshard's checkpoint back to the original HF weights, mtp.* included, bit for bit (`bridges_own_import`)."""
    ours = bridges_own_import(bridge_hybrids, "qwen3_next_all_moe_mtp")
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
            "mtp.layers.0.transformer_layer.mlp.shared_experts.gate_weight"} <= ours.keys()


@pytest.mark.slow
def test_the_comparison_with_bridges_import_fails_on_swapped_mtp_norms(bridge_hybrids, tmp_path, monkeypatch):
    """The same comparison can fail: reshard's import with pre_fc_norm_embedding and pre_fc_norm_hidden swapped differs
    from Bridge's in exactly the MTP layer's enorm and hnorm."""
    import reshard.converters.qwen3_next as qwen3_next

    right, swap = qwen3_next.release_mtp_layer, {"mtp.layers.0.enorm.weight": "mtp.layers.0.hnorm.weight"}
    swap.update({v: k for k, v in swap.items()})

    def swapped(config, layer):
        return [Rename(swap[m.megatron], *m.hf) if m.megatron in swap else m for m in right(config, layer)]

    monkeypatch.setattr(qwen3_next, "release_mtp_layer", swapped)
    cli("convert", bridge_hybrids / "qwen3_next_all_moe_mtp" / "hf", tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "-q")
    ours = dist_tensors(tmp_path / "m" / "iter_0000000")
    theirs = dist_tensors(bridge_hybrids / "qwen3_next_all_moe_mtp" / "bridge" / "ckpt" / "iter_0000000")
    assert sorted(k for k in ours if not torch.equal(ours[k], theirs[k])) == ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight"]


# --------------------------------------------------------------------------------------------------
# Qwen3.5 and Qwen3.5-MoE against Megatron-Bridge's own import (its qwen35_bridge)
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,expected", [
    ("qwen3_5_mtp", {"decoder.layers.0.self_attention.in_proj.weight.alpha", "decoder.layers.1.mlp.linear_fc1.weight",
                     "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight"}),
    ("qwen3_5_moe_mtp", {"decoder.layers.0.self_attention.in_proj.weight.alpha", "decoder.layers.1.mlp.shared_experts.gate_weight",
                         "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight",
                         "mtp.layers.0.transformer_layer.mlp.shared_experts.gate_weight"}),
    ("qwen3_5_moe_fused", {"decoder.layers.3.mlp.experts.experts.linear_fc2.weight"}),
])
def test_reshards_qwen3_5_checkpoint_is_bridges_own_import_and_bridge_exports_it_back(bridge_hybrids, name, expected):
    """Bridge 0.6.2's Qwen35Bridge and Qwen35MoEBridge (the in_proj split four ways, dense or MoE MLPs, the release's MTP
    layer; Qwen3.5-MoE's experts per expert or fused as released): reshard's `--for bridge` holds Bridge's tensors, and
    Bridge exports reshard's checkpoint back to the original HF weights bit for bit, in the form they came
    (`bridges_own_import`)."""
    ours = bridges_own_import(bridge_hybrids, name)
    assert expected <= ours.keys()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5_mtp", "qwen3_5_moe_mtp"])
def test_the_comparison_with_bridges_qwen3_5_import_fails_on_swapped_b_and_a(bridge_hybrids, tmp_path, monkeypatch, name):
    """The same comparison can fail: reshard's import with Qwen3.5's in_proj_b and in_proj_a (the same shape) swapped
    differs from Bridge's in exactly the Gated DeltaNet layers' beta and alpha parts."""
    import reshard.converters.qwen3_5 as qwen3_5

    right, swap = qwen3_5.split_in_proj, {"beta": "alpha", "alpha": "beta"}

    def swapped(config, prefix="model."):
        return [Rename(f"{m.megatron.rsplit('.', 1)[0]}.{swap[m.megatron.rsplit('.', 1)[1]]}", *m.hf)
                if m.megatron.rsplit(".", 1)[1] in swap else m for m in right(config, prefix)]

    monkeypatch.setattr(qwen3_5, "split_in_proj", swapped)
    cli("convert", bridge_hybrids / name / "hf", tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "-q")
    ours = dist_tensors(tmp_path / "m" / "iter_0000000")
    theirs = dist_tensors(bridge_hybrids / name / "bridge" / "ckpt" / "iter_0000000")
    assert sorted(k for k in ours if not torch.equal(ours[k], theirs[k])) == [
        f"decoder.layers.{i}.self_attention.in_proj.weight.{part}" for i in (0, 2) for part in ("alpha", "beta")]
