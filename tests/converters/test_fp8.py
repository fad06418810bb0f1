"""fp8 block-scaled HF models (DeepSeek-V3's release form) through reshard: imported dequantized bit for bit as
the tests' own torch recipe (and transformers, tests/reshard/test_fp8_blocks.py) computes it, exported back to
the same fp8 bytes, and malformed ones refused in one line with the source left as it was."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_hf_roundtrip import assert_loads_cleanly, cli

from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.sharding import slabs
from reshard.verify import verify
from tests.cli import refused_cli
from tests.fp8_models import LINEAR, dequantize, dequantized, load, make_fp8, quantize

from hf_models import build

EDGES = (48, 40)  # no dimension of the tiny Llama is a whole number of these: every edge block is partial


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def tree(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    llama = build("llama", root / "llama")
    return {"llama": llama, "fp8": make_fp8(llama, root / "fp8", EDGES)}


def test_the_logical_view_is_dequantized_and_has_no_scales(models):
    with open_checkpoint(models["fp8"]) as reader:
        assert not [n for n in reader.specs if "scale" in n]
        assert reader.default_dtype == "bfloat16"
        assert reader.specs["decoder.layers.self_attn.linear_qkv.weight".replace("self_attn", "self_attention")].dtype == "float32"
        assert reader.specs["embedding.word_embeddings.weight"].dtype == "bfloat16"


@pytest.mark.parametrize("via,dtype", [("torch_dist", "fp32"), ("zarr", "fp32"), ("torch_dist", None)])
def test_import_is_the_dequantization_bit_for_bit(models, tmp_path, via, dtype):
    middle, back = tmp_path / "middle", tmp_path / "back"
    cli("convert", models["fp8"], middle, "--to-format", via, *(["--dtype", dtype] if dtype else []), "-q")
    cli("convert", middle, back, "--to-format", "hf", "-q")
    expected = dequantized(models["fp8"], EDGES)  # float32 products
    exported = load(back)
    assert exported.keys() == expected.keys()
    for name, value in expected.items():
        assert same_bits(exported[name], value if dtype else value.to(torch.bfloat16)), name  # default: bf16, rounded once
    config = json.loads((back / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == ("float32" if dtype else "bfloat16")
    assert_loads_cleanly(back)


def test_to_fp8_blocks_gives_the_source_bytes_back(models, tmp_path):
    """Through float32 the round trip is exact: a block's largest value is +-448 steps of its scale s, so the
    recomputed scale is float32(float32(448 s) / 448) = s here and each q*s divides back to q. Through bf16
    (the default) the weights' float8 bytes come back too, but the scales only to bf16's rounding of 448 s
    (2^-8): bf16 cannot carry them."""
    source = models["fp8"]
    for dtype in ("fp32", "bf16"):
        middle, back = tmp_path / f"mcore-{dtype}", tmp_path / f"back-{dtype}"
        cli("convert", source, middle, "--to-format", "torch_dist", "--dtype", dtype, "-q")
        said = cli("convert", middle, back, "--to-format", "hf", "--to-fp8-blocks")
        assert "NOT bit-identical" in said and "checksums verified against the values stored" in said
        original, exported = load(source), load(back)
        assert exported.keys() == original.keys()
        for name, value in original.items():
            if dtype == "bf16" and name.endswith("_scale_inv"):
                assert ((exported[name] - value).abs() <= value * 2.0**-8).all(), name
            elif value.dtype == torch.float8_e4m3fn or dtype == "bf16":
                assert same_bits(exported[name], value), name
            else:
                assert same_bits(exported[name], value.float()), name
        config = json.loads((back / "config.json").read_text())
        assert config["quantization_config"] == json.loads((source / "config.json").read_text())["quantization_config"]
        assert verify(back).comparison.ok  # its manifest holds the dequantized values' checksums
        provenance = json.loads((back / "reshard_manifest.json").read_text())["provenance"]
        assert provenance["fp8_blocks"]["weight_block_size"] == list(EDGES)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3_moe"])
def test_experts_round_trip_through_expert_parallel_megatron(tmp_path, name):
    """Every expert's projections quantized (and DeepSeek-V3's MLA down and up projections), the router not;
    resharded to EP2 and back, the same bytes."""
    source = make_fp8(build(name, tmp_path / "plain"), tmp_path / "fp8", (16, 24))
    cli("convert", source, tmp_path / "mcore", "--to-format", "torch_dist", "--to-ep", "2", "--dtype", "fp32", "-q")
    cli("convert", tmp_path / "mcore", tmp_path / "back", "--to-format", "hf", "--to-fp8-blocks", "-q")
    original, exported = load(source), load(tmp_path / "back")
    assert exported.keys() == original.keys()
    assert sum(".experts." in n and t.dtype == torch.float8_e4m3fn for n, t in original.items()) == 2 * 4 * 3
    for hf_name, value in original.items():
        assert same_bits(exported[hf_name], value if value.dtype != torch.bfloat16 else value.float()), hf_name


# MiniMax-M2's release spells the format as torch names it and lists what it leaves unquantized (the router and its bias)
MINIMAX_FP8 = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8", "weight_block_size": [16, 24],
               "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def _minimax_fp8(tmp_path, quantization=MINIMAX_FP8) -> Path:
    source = make_fp8(build("minimax_m2", tmp_path / "plain"), tmp_path / "fp8", (16, 24))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization)))
    return source


@pytest.mark.parametrize("layout", [["--to-tp", "2"], ["--to-ep", "2"]], ids=["tp2", "ep2"])
def test_minimax_m2_fp8_release_form_round_trips(tmp_path, layout):
    """MiniMax-M2 as released: its attention and experts fp8 in blocks, its router not; through torch_dist at TP2 (the
    full-width q/k norms split) or EP2 and back with --to-fp8-blocks, the same bytes and the same quantization_config."""
    source = _minimax_fp8(tmp_path)
    cli("convert", source, tmp_path / "mcore", "--to-format", "torch_dist", *layout, "--dtype", "fp32", "-q")
    cli("convert", tmp_path / "mcore", tmp_path / "back", "--to-format", "hf", "--to-fp8-blocks", "-q")
    original, exported = load(source), load(tmp_path / "back")
    assert exported.keys() == original.keys()
    assert {n for n, t in original.items() if t.dtype == torch.float8_e4m3fn} == {n for n in original if LINEAR.search(n)}
    assert not any(".gate." in n or "norm" in n for n in original if n.endswith("_scale_inv"))
    for hf_name, value in original.items():
        assert same_bits(exported[hf_name], value if value.dtype != torch.bfloat16 else value.float()), hf_name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"] == MINIMAX_FP8


def test_an_fp8_export_its_config_would_misdescribe_is_refused(tmp_path):
    """A source whose modules_to_not_convert names a module fp8 block export quantizes (its attention here): refused
    naming the field and the module, nothing written."""
    source = _minimax_fp8(tmp_path, dict(MINIMAX_FP8, modules_to_not_convert=["gate", "self_attn"]))
    cli("convert", source, tmp_path / "mcore", "--to-format", "torch_dist", "-q")
    with pytest.raises(ReshardError, match=re.escape("quantization_config.modules_to_not_convert names self_attn (")) as refused:
        cli("convert", tmp_path / "mcore", tmp_path / "back", "--to-format", "hf", "--to-fp8-blocks", "-q")
    assert "\n" not in str(refused.value) and not (tmp_path / "back").exists()


def test_to_fp8_blocks_from_an_unquantized_model(models, tmp_path):
    """DeepSeek's choice of tensors in DeepSeek's blocks (128 x 128: one partial block each here), quantized as
    the tests' own recipe does it, each value within the stated bound."""
    megatron, back = tmp_path / "mcore", tmp_path / "back"
    cli("convert", models["llama"], megatron, "--to-format", "torch_dist", "-q")
    cli("convert", megatron, back, "--to-format", "hf", "--to-fp8-blocks", "-q")
    original, exported = load(models["llama"]), load(back)
    assert {n for n, t in exported.items() if t.dtype == torch.float8_e4m3fn} == {n for n in original if LINEAR.search(n)}
    assert set(exported) == set(original) | {n + "_scale_inv" for n in original if LINEAR.search(n)}
    worst = 0.0
    for name, value in original.items():
        if not LINEAR.search(name):
            assert same_bits(exported[name], value), name
            continue
        values, scales = quantize(value, (128, 128))
        assert same_bits(exported[name], values) and same_bits(exported[name + "_scale_inv"], scales), name
        error = (dequantize(values, scales, (128, 128)) - value).abs()
        bound = (value.abs() * 2.0**-4 + scales.max() * 2.0**-10) * (1 + 2.0**-10)
        worst = max(worst, (error / bound).max().item())
    assert 0.5 < worst <= 1, worst  # within the bound, and rounding to float8 uses most of it somewhere
    assert json.loads((back / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_to_fp8_blocks_is_for_hf_linear_weights(models, tmp_path):
    with pytest.raises(ReshardError, match="--to-fp8-blocks writes HF safetensors, not zarr"):
        cli("convert", models["llama"], tmp_path / "out", "--to-format", "zarr", "--to-fp8-blocks", "-q")
    gpt2 = build("gpt2", tmp_path / "gpt2")
    with pytest.raises(ReshardError, match=r"^HF gpt2 stores decoder\.layers\..* as a Conv1D weight"):
        cli("convert", gpt2, tmp_path / "out", "--to-format", "hf", "--to-fp8-blocks", "-q")
    assert not (tmp_path / "out").exists()


Q = "model.layers.1.self_attn.q_proj.weight"


def _drop_scale(tensors, config):
    del tensors[Q + "_scale_inv"]


def _wrong_scale(tensors, config):
    tensors[Q + "_scale_inv"] = tensors[Q + "_scale_inv"][:, :1].contiguous()


def _scaled_norm(tensors, config):
    tensors["model.norm.weight_scale_inv"] = torch.ones(1, 1)


def _unknown_fmt(tensors, config):
    config["quantization_config"]["fmt"] = "e5m2"


def _unknown_method(tensors, config):
    config["quantization_config"]["quant_method"] = "fbgemm_fp8"


def _no_config(tensors, config):
    del config["quantization_config"]


@pytest.mark.parametrize("damage,message", [
    (_drop_scale, f"tensor {Q} is float8 without its scales {Q}_scale_inv"),
    (_wrong_scale, f"tensor {Q}_scale_inv is F32 [2, 1], but {Q} [64, 64] in blocks of [48, 40] needs F32 [2, 2]"),
    (_scaled_norm, "tensor model.norm.weight_scale_inv scales no float8 weight model.norm.weight"),
    (_unknown_fmt, "HF config: quantization_config.fmt='e5m2' is not supported"),
    (_unknown_method, "HF config: quantization_config.quant_method='fbgemm_fp8' is not supported"),
    (_no_config, "tensor model.layers.0.mlp.down_proj.weight is float8 but config.json has no quantization_config"),
], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_malformed_fp8_models_are_refused_in_one_line(models, tmp_path, damage, message):
    bad = tmp_path / "bad"
    shutil.copytree(models["fp8"], bad)
    tensors, config = load(bad), json.loads((bad / "config.json").read_text())
    damage(tensors, config)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(config))
    before = tree(bad)
    with pytest.raises(ReshardError, match=re.escape(message)) as refused:
        cli("convert", bad, tmp_path / "out", "--to-format", "torch_dist", "-q")
    assert "\n" not in str(refused.value)
    assert tree(bad) == before and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))


def _scale(value):
    def damage(tensors):
        tensors[Q + "_scale_inv"][1, 0] = value
    damage.__name__ = f"scale {value}"
    return damage


def _nan_byte(bits):
    def damage(tensors):
        tensors[Q].view(torch.uint8)[50, 7] = bits  # float8_e4m3fn has no inf; S.1111.111 is NaN
    damage.__name__ = f"float8 byte {bits:#x}"
    return damage


@pytest.mark.parametrize("damage,message", [
    (_scale(float("inf")), f"{Q}_scale_inv[1, 0] is inf: a block's scale must be finite and positive"),
    (_scale(float("-inf")), f"{Q}_scale_inv[1, 0] is -inf"),
    (_scale(float("nan")), f"{Q}_scale_inv[1, 0] is nan"),
    (_scale(0.0), f"{Q}_scale_inv[1, 0] is 0.0"),
    (_scale(-0.0), f"{Q}_scale_inv[1, 0] is -0.0"),
    (_scale(-0.5), f"{Q}_scale_inv[1, 0] is -0.5"),
    (_scale(3e38), f"{Q}[48, 0] dequantizes to "),  # finite, but 448 times it is not
    (_nan_byte(0x7F), f"{Q}[50, 7] dequantizes to nan (a float8 NaN"),
    (_nan_byte(0xFF), f"{Q}[50, 7] dequantizes to nan"),
], ids=lambda v: getattr(v, "__name__", None))
def test_a_scale_or_a_float8_value_that_is_no_weight_is_refused(models, tmp_path, monkeypatch, capsys, damage, message):
    """A scale that is not finite and positive, or a float8 NaN, would become inf, NaN, zero or sign-flipped
    weights written under "checksums verified": refused in one line naming the element, the source untouched."""
    bad = tmp_path / "bad"
    shutil.copytree(models["fp8"], bad)
    tensors = load(bad)
    damage(tensors)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    for target in ("torch_dist", "hf"):
        refused_cli(monkeypatch, capsys, ["convert", bad, tmp_path / "out", "--to-format", target, "-q"], message,
                    "the checkpoint is damaged", untouched=(bad,))
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_slab_is_dequantized_one_block_row_at_a_time(tmp_path):
    """Reading one layer of a 1024 x 4096 fp8 weight takes the slab and the HF tensor as float32 and a block row
    in float8 and float32 more (5/32 of the weight), not the whole weight dequantized at once (a float32 copy of
    its float8 values and per-element scales: two weights more)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=8,
                            num_key_value_heads=8, vocab_size=256)
    plain = tmp_path / "plain"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(plain)
    (plain / "tokenizer_config.json").write_text("{}")
    with open_checkpoint(make_fp8(plain, tmp_path / "fp8", (128, 128))) as reader:
        spec = reader.specs["decoder.layers.mlp.linear_fc2.weight"]
        slab = next(iter(slabs(spec)))
        weight = 4096 * 1024 * 4
        tracemalloc.start()
        values = reader.read(spec.name, slab)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert values.nbytes == weight
    assert peak < 2 * weight + weight // 5, peak
