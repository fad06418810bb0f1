"""HF checkpoints made by a hostile user (issue 22): paths that leave the checkpoint, malformed safetensors
(the safetensors library is the oracle), config.json values that do not fit. Each is refused in one line,
exit status 1, with nothing written and the source untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from reshard.converters.base import HF_INTS, HF_NULLABLE, HF_POSITIVE_FLOATS
from reshard.errors import ReshardError
from reshard.formats.hf import _read_header
from tests.cli import refused_cli, run_cli

from hf_models import build


def refused(monkeypatch, capsys, source: Path, out: Path, *words: str, untouched: tuple[Path, ...] = ()) -> None:
    """Converting `source` fails in one `reshard: error:` line with `words`, writes nothing, changes no file."""
    refused_cli(monkeypatch, capsys, ["convert", source, out, "--to-format", "hf", "-q"], *words, untouched=(source, *untouched))
    assert not out.exists() and not any(out.parent.glob(f".{out.name}*"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("hf") / "sharded", max_shard_size="100KB")


@pytest.fixture
def model(sharded, tmp_path):
    return Path(shutil.copytree(sharded, tmp_path / "model"))


# ------------------------------------------------------------------------------ class 3: paths leaving it

def _index(model: Path) -> dict:
    return json.loads((model / "model.safetensors.index.json").read_text())


def _rename_in_index(model: Path, old: str, new: str) -> None:
    index = _index(model)
    index["weight_map"] = {k: (new if v == old else v) for k, v in index["weight_map"].items()}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard(model: Path) -> str:
    return sorted(set(_index(model)["weight_map"].values()))[0]


def _moved_out(model: Path, outside: Path) -> str:
    """The first shard moved to `outside`; its name."""
    shard = _shard(model)
    outside.mkdir(exist_ok=True)
    shutil.move(model / shard, outside / shard)
    return shard


def _dotdot(model, outside):
    shard = _moved_out(model, outside)
    _rename_in_index(model, shard, f"../{outside.name}/{shard}")


def _absolute(model, outside):
    shard = _moved_out(model, outside)
    _rename_in_index(model, shard, str(outside / shard))


def _down_and_up(model, outside):
    shard = _moved_out(model, outside)
    (model / "sub").mkdir()
    _rename_in_index(model, shard, f"sub/../../{outside.name}/{shard}")


def _linked_shard(model, outside):
    shard = _moved_out(model, outside)
    (model / shard).symlink_to(outside / shard)


def _relative_link(model, outside):
    shard = _moved_out(model, outside)
    (model / shard).symlink_to(Path("..") / outside.name / shard)


def _linked_directory(model, outside):
    shard = _moved_out(model, outside)
    (model / "weights").symlink_to(outside)
    _rename_in_index(model, shard, f"weights/{shard}")


def _linked_index(model, outside):
    outside.mkdir()
    shutil.move(model / "model.safetensors.index.json", outside / "index.json")
    (model / "model.safetensors.index.json").symlink_to(outside / "index.json")


def _linked_config(model, outside):
    outside.mkdir()
    shutil.move(model / "config.json", outside / "config.json")
    (model / "config.json").symlink_to(outside / "config.json")


def _single_linked(model, outside):
    """No index: the only model.safetensors is a link out of the directory."""
    outside.mkdir()
    src = build("llama_tied", outside / "other")
    for p in list(model.iterdir()):
        if p.name.endswith(".safetensors") or p.name.endswith(".index.json"):
            p.unlink()
    shutil.copy(src / "config.json", model / "config.json")
    (model / "model.safetensors").symlink_to(src / "model.safetensors")


def _not_safetensors(model, outside):
    outside.mkdir()
    _rename_in_index(model, _shard(model), "/etc/passwd")


LEAVING = [_dotdot, _absolute, _down_and_up, _linked_shard, _relative_link, _linked_directory, _linked_index,
           _linked_config, _single_linked, _not_safetensors]


@pytest.mark.parametrize("leave", LEAVING, ids=lambda f: f.__name__.strip("_"))
def test_a_path_leaving_the_checkpoint_is_refused(model, tmp_path, monkeypatch, capsys, leave):
    outside = tmp_path / "other"
    leave(model, outside)
    refused(monkeypatch, capsys, model, tmp_path / "out", "refusing", untouched=(outside,))
    code, lines = run_cli(monkeypatch, capsys, "inspect", model)
    assert code == 1 and lines[0].startswith("reshard: error:") and "refusing" in lines[0]


def _loop(model):
    (model / "loop.safetensors").symlink_to("loop.safetensors")
    return "loop.safetensors"


@pytest.mark.parametrize("name,words", [
    ("a\0.safetensors", "cannot be followed"),
    ("a" * 300 + ".safetensors", "is missing"),
    (_loop, "cannot be followed"),
    ("", "not a safetensors file"),
    (".", "not a safetensors file"),
    (7, "is not a safetensors index"),
    (["x.safetensors"], "is not a safetensors index"),
])
def test_an_index_naming_what_cannot_be_a_shard_is_refused(model, tmp_path, monkeypatch, capsys, name, words):
    if callable(name):
        name = name(model)
    _rename_in_index(model, _shard(model), name)
    refused(monkeypatch, capsys, model, tmp_path / "out", words)


def test_a_tokenizer_file_leaving_the_source_is_not_exported(model, tmp_path, monkeypatch, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours\n")
    (model / "tokenizer.json").symlink_to(secret)
    code, lines = run_cli(monkeypatch, capsys, "convert", model, tmp_path / "out", "--to-format", "hf", "-q")
    assert code == 1 and lines[0].startswith("reshard: error:") and "refusing" in lines[0], lines
    assert not (tmp_path / "out").exists() and secret.read_text() == "not yours\n"


def test_symlinks_inside_the_checkpoint_and_the_hub_cache_layout_are_read(sharded, tmp_path, monkeypatch, capsys):
    """huggingface_hub's cache: snapshots/<commit>/<file> -> ../../blobs/<sha>; and links within a directory."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sharded.iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob)
    local = tmp_path / "local"
    (local / "weights").mkdir(parents=True)
    for f in sharded.iterdir():
        if f.name.endswith(".safetensors"):
            shutil.copy(f, local / "weights" / f.name)
            (local / f.name).symlink_to(Path("weights") / f.name)
        else:
            shutil.copy(f, local / f.name)
    for source in (snapshot, local):
        code, lines = run_cli(monkeypatch, capsys, "convert", source, tmp_path / f"out-{source.name}", "--to-format", "hf", "-q")
        assert code == 0, lines
    fake = tmp_path / "fake" / "snapshots" / "abc"  # looks like a snapshot, but of no models--* folder
    shutil.copytree(sharded, fake, symlinks=True)
    shard = _shard(fake)
    shutil.move(fake / shard, fake.parent / shard)
    (fake / shard).symlink_to(Path("..") / shard)
    refused(monkeypatch, capsys, fake, tmp_path / "out-fake", "leads outside the checkpoint")


# ------------------------------------------------------------------------ class 5: malformed safetensors

def _file(header: dict | bytes, data: bytes, size: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if size is None else size) + raw + data


def T(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _one(body: str, data: int = 4) -> bytes:
    return _file(("{" + body + "}").encode(), b"\0" * data)


A = '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
CRAFTED = {
    "good": _file({"a": T("F32", [2], 0, 8)}, b"\0" * 8),
    "good_with_metadata": _file({"__metadata__": {"format": "pt"}, "a": T("F32", [2], 0, 8)}, b"\0" * 8),
    "metadata_null": _file({"__metadata__": None, "a": T("F32", [1], 0, 4)}, b"\0" * 4),
    "metadata_not_strings": _file({"__metadata__": {"x": 1}, "a": T("F32", [1], 0, 4)}, b"\0" * 4),
    "metadata_list": _file({"__metadata__": [], "a": T("F32", [1], 0, 4)}, b"\0" * 4),
    "metadata_twice": _one('"__metadata__":{"x":"1"},"__metadata__":{"y":"2"},' + A),
    "empty": _file({}, b""),
    "empty_with_trailing_byte": _file({}, b"x"),
    "trailing_byte": _file({"a": T("F32", [2], 0, 8)}, b"\0" * 9),
    "truncated": _file({"a": T("F32", [2], 0, 8)}, b"\0" * 7),
    "hole": _file({"a": T("F32", [1], 0, 4), "b": T("F32", [1], 8, 12)}, b"\0" * 12),
    "hole_at_start": _file({"a": T("F32", [1], 4, 8)}, b"\0" * 8),
    "overlap": _file({"a": T("F32", [2], 0, 8), "b": T("F32", [1], 4, 8)}, b"\0" * 8),
    "same_range": _file({"a": T("F32", [1], 0, 4), "b": T("F32", [1], 0, 4)}, b"\0" * 4),
    "unsorted_ok": _file({"b": T("F32", [1], 4, 8), "a": T("F32", [1], 0, 4)}, b"\0" * 8),
    "reversed_offsets": _file({"a": T("F32", [0], 4, 0)}, b"\0" * 4),
    "range_shorter_than_shape": _file({"a": T("F32", [3], 0, 8)}, b"\0" * 8),
    "range_longer_than_shape": _file({"a": T("F32", [1], 0, 8)}, b"\0" * 8),
    "dtype_size_mismatch": _file({"a": T("F16", [4], 0, 16)}, b"\0" * 16),
    "scalar": _file({"a": T("F32", [], 0, 4)}, b"\0" * 4),
    "zero_sized": _file({"a": T("F32", [0], 0, 0), "b": T("F32", [1], 0, 4)}, b"\0" * 4),
    "two_zero_sized": _file({"a": T("F32", [0, 3], 0, 0), "b": T("F32", [0], 0, 0)}, b""),
    "unknown_dtype": _file({"a": T("F31", [1], 0, 4)}, b"\0" * 4),
    "lowercase_dtype": _file({"a": T("f32", [1], 0, 4)}, b"\0" * 4),
    "dtype_not_string": _file({"a": T(1, [1], 0, 4)}, b"\0" * 4),
    "U16": _file({"a": T("U16", [2], 0, 4)}, b"\0" * 4),
    "F8_E4M3": _file({"a": T("F8_E4M3", [2], 0, 2)}, b"\0" * 2),
    "F8_E5M2FNUZ": _file({"a": T("F8_E5M2FNUZ", [3], 0, 3)}, b"\0" * 3),
    "F4": _file({"a": T("F4", [2], 0, 1)}, b"\0"),
    "F4_odd_count": _file({"a": T("F4", [3], 0, 2)}, b"\0" * 2),
    "F6": _file({"a": T("F6_E2M3", [4], 0, 3)}, b"\0" * 3),
    "F6_partial_byte": _file({"a": T("F6_E3M2", [3], 0, 3)}, b"\0" * 3),
    "C64": _file({"a": T("C64", [1], 0, 8)}, b"\0" * 8),
    "negative_dim": _file({"a": T("F32", [-1], 0, 4)}, b"\0" * 4),
    "float_dim": _file({"a": T("F32", [1.0], 0, 4)}, b"\0" * 4),
    "bool_dim": _file({"a": T("F32", [True], 0, 4)}, b"\0" * 4),
    "string_dim": _file({"a": T("F32", ["1"], 0, 4)}, b"\0" * 4),
    "shape_not_list": _file({"a": T("F32", 1, 0, 4)}, b"\0" * 4),
    "shape_object": _file({"a": T("F32", {"0": 1}, 0, 4)}, b"\0" * 4),
    "dim_past_u64": _file({"a": T("F32", [2**64], 0, 4)}, b"\0" * 4),
    "elements_overflow": _file({"a": T("F32", [2**40, 2**40], 0, 4)}, b"\0" * 4),
    "bits_overflow": _file({"a": T("F64", [2**61], 0, 4)}, b"\0" * 4),
    "float_offset": _file({"a": T("F32", [1], 0.0, 4)}, b"\0" * 4),
    "negative_offset": _file({"a": T("F32", [1], -4, 0)}, b"\0" * 4),
    "three_offsets": _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 4]}}, b"\0" * 4),
    "one_offset": _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, b"\0" * 4),
    "missing_shape": _file({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, b"\0" * 4),
    "missing_dtype": _file({"a": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "missing_offsets": _file({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4),
    "extra_field": _file({"a": {**T("F32", [1], 0, 4), "note": [1, {"x": None}]}}, b"\0" * 4),
    "field_twice": _one('"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"dtype":"F32"}'),
    "name_twice_same": _one(A + "," + A),
    "name_twice_last_wrong": _one(A + ',"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}', 8),
    "name_twice_first_wrong": _one('"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},' + A),
    "tensor_not_object": _one('"a":1', 0),
    "tensor_null": _one('"a":null', 0),
    "header_list": _file(b"[]", b""),
    "header_string": _file(b'"x"', b""),
    "header_empty": _file(b"", b""),
    "leading_spaces": _file(b"  {" + A.encode() + b"}", b"\0" * 4),
    "trailing_spaces": _file(b"{" + A.encode() + b"}    ", b"\0" * 4),
    "trailing_newline_tab": _file(b"{" + A.encode() + b"}\n\t\r", b"\0" * 4),
    "trailing_nul": _file(b"{" + A.encode() + b"}\0", b"\0" * 4),
    "trailing_junk": _file(b"{" + A.encode() + b"} x", b"\0" * 4),
    "two_objects": _file(b"{" + A.encode() + b"}{}", b"\0" * 4),
    "nan_in_extra_field": _one('"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":NaN}'),
    "infinity": _one('"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}'),
    "lone_surrogate_name": _one('"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'),
    "surrogate_pair_name": _one('"\\ud83d\\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'),
    "lone_surrogate_metadata": _one('"__metadata__":{"a":"\\udfff"},' + A),
    "invalid_utf8": _file(b'{"\xff":' + A.encode()[4:] + b"}", b"\0" * 4),
    "unclosed": _file(b"{" + A.encode(), b"\0" * 4),
    "header_longer_than_file": _file(b"{}", b"", size=50),
    "header_too_large": _file(b"{}", b"", size=100_000_001),
    "header_at_the_limit_past_eof": _file(b"{}", b"", size=100_000_000),
    "shorter_than_8_bytes": b"\0\0\0",
    "nothing": b"",
    "deep_nesting": _one('"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + "[" * 100_000 + "]" * 100_000 + "}"),
}


def _library_accepts(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "np") as f:
            list(f.keys())
        return True
    except SafetensorError:
        return False


def _reshard_accepts(path: Path) -> bool:
    try:
        _read_header(path)
        return True
    except ReshardError as exc:
        assert "\n" not in str(exc)
        return False


def _mutations(real: bytes) -> dict[str, bytes]:
    """Variants of a real model's shard: each tensor's offsets, shape and dtype damaged one at a time."""
    (size,) = struct.unpack("<Q", real[:8])
    header = json.loads(real[8 : 8 + size])
    data = real[8 + size :]
    names = [n for n in header if n != "__metadata__"]
    out = {"real": real, "real_plus_a_byte": real + b"\0", "real_less_a_byte": real[:-1]}

    def variant(key: str, change) -> None:
        h = json.loads(json.dumps(header))
        change(h)
        out[key] = _file(h, data)

    for i, name in enumerate(names):
        def shift(h, name=name, by=(0, 2)):
            h[name]["data_offsets"] = [h[name]["data_offsets"][0] + by[0], h[name]["data_offsets"][1] + by[1]]
        variant(f"{name}:end+2", shift)
        variant(f"{name}:start-2", lambda h, name=name: shift(h, name, (-2, 0)) if h[name]["data_offsets"][0] >= 2 else None)
        variant(f"{name}:both+2", lambda h, name=name: shift(h, name, (2, 2)))
        variant(f"{name}:row_less", lambda h, name=name: h[name]["shape"].__setitem__(0, h[name]["shape"][0] - 1))
        variant(f"{name}:flat", lambda h, name=name: h[name].__setitem__("shape", [h[name]["shape"][0] * (h[name]["shape"][1:] or [1])[0]]))
        variant(f"{name}:as_F16", lambda h, name=name: h[name].__setitem__("dtype", "F16"))
        variant(f"{name}:as_I32", lambda h, name=name: h[name].__setitem__("dtype", "I32"))
        variant(f"{name}:dropped", lambda h, name=name: h.pop(name))
        if i + 1 < len(names):
            other = names[i + 1]
            variant(f"{name}:swapped_with_next", lambda h, a=name, b=other: (
                h[a].__setitem__("data_offsets", header[b]["data_offsets"]), h[b].__setitem__("data_offsets", header[a]["data_offsets"])))
    return out


def test_the_safetensors_library_is_the_oracle(sharded, tmp_path):
    """reshard refuses a safetensors file exactly when the safetensors library does, always in one line."""
    cases = dict(CRAFTED)
    shard = sorted(sharded.glob("*.safetensors"))[0]
    cases.update(_mutations(shard.read_bytes()))
    assert len(cases) > 100
    disagree, refusals = [], 0
    for name, blob in cases.items():
        path = tmp_path / "case.safetensors"
        path.write_bytes(blob)
        library, ours = _library_accepts(path), _reshard_accepts(path)
        refusals += not ours
        if library != ours:
            disagree.append(f"{name}: library {'accepts' if library else 'refuses'}, reshard {'accepts' if ours else 'refuses'}")
    assert not disagree, disagree
    assert refusals > 80  # the cases are mostly malformed: the oracle is not accepting everything


@pytest.mark.parametrize("damage", ["overlap", "hole", "trailing", "short_range", "unknown_dtype", "metadata_twice"])
def test_a_malformed_shard_of_a_model_is_refused_in_one_line(model, tmp_path, monkeypatch, capsys, damage):
    shard = model / _shard(model)
    real = shard.read_bytes()
    (size,) = struct.unpack("<Q", real[:8])
    header, data = json.loads(real[8 : 8 + size]), real[8 + size :]
    first, second = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])[:2]
    raw = None
    if damage == "overlap":
        header[first]["data_offsets"][1] += 4
    elif damage == "hole":
        header[second]["data_offsets"] = [o + 4 for o in header[second]["data_offsets"]]
    elif damage == "trailing":
        data += b"\0" * 4
    elif damage == "short_range":
        header[first]["shape"][0] += 1
    elif damage == "unknown_dtype":
        header[first]["dtype"] = "BF17"
    else:
        raw = b'{"__metadata__":{},' + json.dumps(header).encode()[1:]
    shard.write_bytes(_file(raw or header, data))
    assert not _library_accepts(shard)
    refused(monkeypatch, capsys, model, tmp_path / "out", shard.name)


# ---------------------------------------------------------------- class 6: config.json values that do not fit

@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build(name, root / name) for name in ("llama", "gpt2", "mixtral", "qwen3", "qwen2_moe", "deepseek_v3")}


def _edit_config(source: Path, target: Path, field: str, value) -> Path:
    """A copy of `source` whose config.json has `field` (dotted: inside an object) set to `value`."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    *parents, last = field.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[last] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


MUST_REFUSE = [
    ("llama", "num_attention_heads", 3, "num_attention_heads=3"),
    ("llama", "num_attention_heads", True, "num_attention_heads=true"),
    ("llama", "num_attention_heads", "4", 'num_attention_heads="4"'),
    ("llama", "num_key_value_heads", 3, "num_key_value_heads=3"),
    ("llama", "num_hidden_layers", 0, "num_hidden_layers=0"),
    ("llama", "num_hidden_layers", 1.5, "num_hidden_layers=1.5"),
    ("llama", "hidden_size", None, "hidden_size=null"),
    ("llama", "head_dim", 0, "head_dim=0"),
    ("llama", "intermediate_size", -128, "intermediate_size=-128"),
    ("llama", "vocab_size", 251, "vocab_size=251"),
    ("llama", "vocab_size", 2**40, "vocab_size="),
    ("llama", "max_position_embeddings", "abc", "max_position_embeddings"),
    ("llama", "rms_norm_eps", "abc", 'rms_norm_eps="abc"'),
    ("llama", "rms_norm_eps", -1e-6, "rms_norm_eps"),
    ("llama", "rms_norm_eps", 0, "rms_norm_eps=0"),
    ("llama", "rms_norm_eps", float("nan"), "rms_norm_eps=NaN"),
    ("llama", "rms_norm_eps", 5, "rms_norm_eps=5"),
    ("llama", "rope_parameters.rope_theta", "abc", "rope_theta"),
    ("llama", "rope_parameters.rope_theta", -1, "rope_theta"),
    ("llama", "rope_parameters.factor", "abc", "rope_scaling.factor"),
    ("llama", "rope_parameters.factor", -8, "rope_scaling.factor"),
    ("llama", "rope_parameters.low_freq_factor", [1], "rope_scaling.low_freq_factor"),
    ("llama", "tie_word_embeddings", "false", "tie_word_embeddings"),
    ("gpt2", "n_head", 3, "n_head=3"),
    ("gpt2", "n_embd", "64", "n_embd"),
    ("gpt2", "layer_norm_epsilon", "abc", "layer_norm_epsilon"),
    ("gpt2", "n_layer", -2, "n_layer=-2"),
    ("mixtral", "num_experts_per_tok", 5, "num_experts_per_tok=5"),
    ("mixtral", "num_local_experts", 0, "num_local_experts=0"),
    ("mixtral", "rope_theta", {}, "rope_theta"),
    ("qwen3", "rope_scaling", "yarn", "rope_scaling"),
    ("qwen3", "partial_rotary_factor", "half", "partial_rotary_factor"),
    ("qwen2_moe", "norm_topk_prob", "false", 'norm_topk_prob="false"'),
    ("qwen2_moe", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0"),
    ("qwen2_moe", "decoder_sparse_step", 0, "decoder_sparse_step=0"),
    ("qwen2_moe", "mlp_only_layers", [2], "mlp_only_layers"),
    ("qwen2_moe", "mlp_only_layers", "1", "mlp_only_layers"),
    ("qwen2_moe", "mlp_only_layers", [0, 1], "every layer is dense"),
    ("deepseek_v3", "kv_lora_rank", 0, "kv_lora_rank=0"),
    ("deepseek_v3", "q_lora_rank", "24", 'q_lora_rank="24"'),
    ("deepseek_v3", "first_k_dense_replace", None, "first_k_dense_replace=null"),
    ("deepseek_v3", "rope_parameters.original_max_position_embeddings", 0, "original_max_position_embeddings=0"),
    ("deepseek_v3", "rope_parameters.mscale", "abc", "rope_scaling.mscale"),
    # no tensor's shape pins these down: a negative or zero routing scale flips or zeroes every expert's output
    ("deepseek_v3", "routed_scaling_factor", -1, "routed_scaling_factor=-1 is not a positive number"),
    ("deepseek_v3", "routed_scaling_factor", 0, "routed_scaling_factor=0 is not a positive number"),
    ("deepseek_v3", "routed_scaling_factor", float("nan"), "routed_scaling_factor=NaN"),
    ("deepseek_v3", "routed_scaling_factor", "2.5", 'routed_scaling_factor="2.5"'),
]


@pytest.mark.parametrize("depth", [33, 1000, 20_000])
def test_a_config_json_nested_too_deep_is_refused(model, tmp_path, monkeypatch, capsys, depth):
    """Its values ride in the args reshard pickles into its output: nested thousands deep it ended in a
    RecursionError (an internal error), and a few hundred deep, in one as the output was written."""
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config[: config.rindex("}")] + ', "deep": ' + "[" * depth + "]" * depth + "}")
    refused_cli(monkeypatch, capsys, ["inspect", model], "config.json nests deeper than 32 levels", untouched=(model,))
    refused(monkeypatch, capsys, model, tmp_path / "out", "config.json nests deeper than 32 levels")


@pytest.mark.parametrize("family,field,value,words", MUST_REFUSE, ids=lambda v: str(v)[:20])
def test_a_config_value_that_does_not_fit_is_refused_naming_the_field(families, tmp_path, monkeypatch, capsys, family, field, value, words):
    source = _edit_config(families[family], tmp_path / "model", field, value)
    refused(monkeypatch, capsys, source, tmp_path / "out", words)


READ = {*HF_INTS, *HF_POSITIVE_FLOATS, "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
BAD_VALUES = ["abc", "4", -1, 0, 1.5, True, False, None, [], [4], {}, {"a": 1}, float("nan"), float("inf"), 1e30, 2**40, 2**70, 3, 7]


def _fields(config: dict, prefix: str = "") -> list[str]:
    """Every key of config.json, and of the objects in it (dotted)."""
    out = []
    for key, value in config.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out += _fields(value, f"{prefix}{key}.")
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "qwen3", "qwen2_moe", "deepseek_v3"])
def test_fuzzed_config_values_never_end_in_an_internal_error(families, tmp_path, monkeypatch, capsys, family):
    """Every field of config.json set to each of BAD_VALUES, and config.json one of them: inspect answers or
    refuses in one line, never
    exit 2; a field the converter reads is refused when it is no number (null: the default, for those that have one)."""
    source = families[family]
    fields = _fields(json.loads((source / "config.json").read_text()))
    assert len(fields) >= 20
    refusals = 0
    for n, (field, value) in enumerate((f, v) for f in fields for v in BAD_VALUES):
        model = _edit_config(source, tmp_path / f"m{n}", field, value)
        code, lines = run_cli(monkeypatch, capsys, "inspect", model)
        assert code in (0, 1), (field, value, lines)
        if code == 1:
            refusals += 1
            assert len(lines) == 1 and lines[0].startswith("reshard: error:"), (field, value, lines)
        elif field.split(".")[-1] in READ and (isinstance(value, str) or value is None and field.split(".")[-1] not in (*HF_NULLABLE, "rope_theta")):
            raise AssertionError(f"{field}={value!r} was accepted")
        shutil.rmtree(model)
    for value in BAD_VALUES:
        model = shutil.copytree(source, tmp_path / "whole")
        (model / "config.json").write_text(json.dumps(value))
        code, lines = run_cli(monkeypatch, capsys, "inspect", model)
        assert code == 1 and len(lines) == 1 and lines[0].startswith("reshard: error:"), (value, lines)
        shutil.rmtree(model)
    assert refusals > len(fields) * len(BAD_VALUES) // 4


TENSORS = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.1.self_attn.k_proj.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.gate_proj.weight"]


@pytest.mark.parametrize("tensor", TENSORS)
def test_a_tensor_at_another_shape_than_config_json_implies_is_refused(model, tmp_path, monkeypatch, capsys, tensor):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shard = model / _index(model)["weight_map"][tensor]
    original = load_file(shard)
    for n, shape in enumerate([(), (7,), (250,), (250, 64, 1), (1, 250, 64), (0, 64), (64, 0), (16, 16)]):
        tensors = dict(original, **{tensor: np.zeros(shape, np.float32)})
        save_file(tensors, shard, metadata={"format": "pt"})
        refused(monkeypatch, capsys, model, tmp_path / f"out{n}", tensor)
