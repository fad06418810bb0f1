"""The master-weight check guards every decode of DistributedOptimizer buffers (dp_reshardable, distrib_optim.pt):
the oracle is megatron-core itself, which copies its fp32 master weights into the model after every step, so the
weights it saved are the master weights rounded to the model's dtype (fixture `distrib_optim`: Megatron's own
saves). A buffer whose parameters sit in each other's place keeps every bucket length, so only this check sees it."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats.megatron_dist import TorchDistReader
from reshard.formats.megatron_legacy import LegacyReader
from reshard.optim import master_weights
from reshard.optim.order import LAYER_ORDERS, MULTI_HEAD
from reshard.request import LayoutChange, Target
from reshard.torchfile import dcp_metadata
from reshard.torchfile.dcp_metadata import Storage
from tests.reshard.optim.test_dp_reshardable import ITER
from tests.reshard.test_cli import _digest, _one_line_error, reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

QKV = "decoder.layers.self_attention.linear_qkv.weight"


class _Master:
    """A move of one master-weight tensor, as `master_weights.mismatched` takes it."""

    def __init__(self, spec):
        self.source = spec


def _mismatched(reader) -> tuple[list[str], int]:
    masters = [_Master(spec) for name, spec in reader.specs.items() if master_weights.master_of(name)]
    return master_weights.mismatched(reader, masters), len(masters)


@pytest.mark.parametrize(
    "preset, layout, form, bf16",
    [
        ("tiny-odd", {"tp": 2}, "dp", False),
        ("tiny-odd", {"tp": 2}, "dp", True),
        ("tiny-odd", {"tp": 2}, "legacy", True),
        ("tiny-odd-tied", {"tp": 1, "pp": 2, "vpp": 2, "bucket_size": 3000}, "dp", False),
        ("tiny-odd-tied", {"tp": 1, "pp": 2, "vpp": 2, "bucket_size": 3000}, "legacy", False),
        ("tiny-moe", {"tp": 1, "ep": 2}, "dp", False),
    ],
    ids=["tp2", "tp2-bf16", "legacy-tp2-bf16", "tied-pp2-vpp2-buckets", "legacy-tied-pp2-vpp2-buckets", "moe-ep2"],
)
def test_megatrons_own_buffer_saves_pass(distrib_optim, preset, layout, form, bf16):
    """Every master tensor decoded from Megatron's own save agrees with its saved weights (bf16: the master
    rounded to bf16 is the weight, while the fp32 master itself is not: the rounding is what is compared)."""
    path = distrib_optim(preset, bf16=bf16, **layout)[form]
    with (LegacyReader if form == "legacy" else TorchDistReader)(path) as reader:
        assert master_weights.decoded_from_buffers(reader)
        bad, count = _mismatched(reader)
        assert bad == [] and count == len([s for s in reader.specs.values() if not s.is_optimizer])
        if bf16:
            spec = reader.specs[QKV]
            weights = reader.read(QKV, tuple((0, d) for d in spec.shape))
            master = reader.read(f"optimizer.state.param.{QKV}", tuple((0, d) for d in spec.shape))
            assert weights.dtype.name == "bfloat16" and not np.array_equal(master, weights.astype(np.float32))


def _places(path: Path, a: tuple[str, int], b: tuple[str, int]):
    """Where parameters `a` and `b` ((name, layer) on TP rank 0) lie in the buckets, as reshard derives it."""
    with TorchDistReader(path) as reader:
        placed = reader.optimizer.placed
        return placed[(*a, None, 0, 0, 0)], placed[(*b, None, 0, 0, 0)]


def _swap_in_buckets(source: Path, dest: Path, a: tuple[str, int], b: tuple[str, int]) -> None:
    """A copy of Megatron's dp_reshardable save `source` in which parameters `a` and `b` (same size, same bucket)
    trade places in every state tensor: each chunk of the bucket rewritten, appended to its .distcp file and
    .metadata pointed at it (every length stays as saved)."""
    (gbuf, pa), (gbuf_b, pb) = _places(source, a, b)
    assert gbuf == gbuf_b and pa.bucket == pb.bucket and pa.numel == pb.numel
    shutil.copytree(source, dest)
    directory = dest / ITER
    metadata = dcp_metadata.load(directory / ".metadata")
    for state in ("param", "exp_avg", "exp_avg_sq"):
        key = next(k for k in metadata.tensors if k.startswith(f"{gbuf}.") and k.endswith(f".bucket_idx_{pa.bucket}.{state}"))
        whole = torch.empty(metadata.tensors[key].size, dtype=torch.float32)
        chunks = metadata.tensors[key].chunks
        for chunk in chunks:
            s = metadata.storage[(key, chunk.offsets)]
            with open(directory / s.relative_path, "rb") as f:
                f.seek(s.offset)
                part = torch.load(io.BytesIO(f.read(s.length)), weights_only=True)
            whole[chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]] = part
        first = whole[pa.start : pa.start + pa.numel].clone()
        whole[pa.start : pa.start + pa.numel] = whole[pb.start : pb.start + pb.numel]
        whole[pb.start : pb.start + pb.numel] = first
        for chunk in chunks:
            old = metadata.storage[(key, chunk.offsets)]
            blob = io.BytesIO()
            torch.save(whole[chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]].clone(), blob)
            path = directory / old.relative_path
            offset = path.stat().st_size
            with open(path, "ab") as f:
                f.write(blob.getvalue())
            metadata.storage[(key, chunk.offsets)] = Storage(old.relative_path, offset, len(blob.getvalue()))
    dcp_metadata.save(directory / ".metadata", metadata)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_parameters_swapped_in_megatrons_buckets_are_refused_and_nothing_is_written(distrib_optim, tmp_path, bf16):
    """Layers 0 and 1 of linear_qkv trade places in TP rank 0's bucket of Megatron's own save: the bucket lengths
    all agree, but the master weights decoded for them are the other layer's, and the conversion says so."""
    source = distrib_optim("tiny-odd", tp=2, bf16=bf16)["dp"]
    _swap_in_buckets(source, tmp_path / "bad", (QKV, 0), (QKV, 1))
    before = _digest(tmp_path / "bad")
    with TorchDistReader(tmp_path / "bad") as reader:  # the bucket lengths pass: the reader opens it
        assert _mismatched(reader)[0] == [QKV]
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-tp", "1")
    _one_line_error(result, f"{QKV}: the fp32 master weights decoded", "1 parameter(s) disagree", "--no-optimizer")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.reshard-*"))
    assert _digest(tmp_path / "bad") == before
    assert reshard("convert", tmp_path / "bad", tmp_path / "model", "--to-tp", "1", "--no-optimizer").returncode == 0


def test_the_sampled_check_covers_every_layer_and_expert_at_a_few_rows_each(distrib_optim, tmp_path):
    """A conversion checks decoded master weights on the edges of every parameter (`_edges`): of each layer and expert
    a stacked piece holds, its first and last rows, not the piece's first and last layers whole. Two middle layers
    traded in Megatron's own bucket (every bucket length right) are refused by the conversion's sampled check."""
    with TorchDistReader(distrib_optim("tiny-moe", tp=1, ep=2)["dp"]) as reader:
        for name in (QKV, "decoder.layers.mlp.experts.experts.linear_fc1.weight", "decoder.layers.mlp.router.weight"):
            spec = reader.specs[name]
            regions = list(master_weights._edges(reader, spec))
            stacked = {tuple(r[: spec.prefix_axes]) for r in regions}
            assert stacked == {tuple((i, i + 1) for i in index) for index in np.ndindex(spec.shape[: spec.prefix_axes])}, name
            assert sum(int(np.prod([b - a for a, b in r])) for r in regions) <= 4 * np.prod(spec.shape) / spec.shape[spec.prefix_axes], name
    source = distrib_optim("tiny-odd", tp=2)["dp"]
    _swap_in_buckets(source, tmp_path / "bad", (QKV, 1), (QKV, 2))
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-tp", "1")
    _one_line_error(result, f"{QKV}: the fp32 master weights decoded", "1 parameter(s) disagree", "--no-optimizer")
    assert not (tmp_path / "out").exists()


def test_two_parameters_swapped_in_distrib_optim_pt_are_refused(distrib_optim, tmp_path):
    """The same swap in the legacy format's distrib_optim.pt (megatron-core's own save_parameter_state) of TP rank 0."""
    made = distrib_optim("tiny-odd", tp=2)
    (gbuf, pa), (_, pb) = _places(made["dp"], (QKV, 0), (QKV, 1))  # the same run, the same buffer layout
    shutil.copytree(made["legacy"], tmp_path / "bad")
    path = next((tmp_path / "bad" / ITER).glob("mp_rank_00*/distrib_optim.pt"))
    state = torch.load(path, weights_only=False)  # the fixture's own file
    with LegacyReader(made["legacy"]) as reader:
        buffer = reader.optimizer.buffer_layout.buffers[gbuf]
        a, b = buffer.coalesced_start(pa), buffer.coalesced_start(pb)
    for tensors in state[gbuf.index].values():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            first = tensors[key][a : a + pa.numel].clone()
            tensors[key][a : a + pa.numel] = tensors[key][b : b + pb.numel]
            tensors[key][b : b + pb.numel] = first
    torch.save(state, path)
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-format", "torch_dist", "--to-tp", "1")
    _one_line_error(result, f"{QKV}: the fp32 master weights decoded", "--no-optimizer")
    assert not (tmp_path / "out").exists()


def test_a_wrong_order_of_reshards_own_is_refused(distrib_optim, tmp_path, monkeypatch):
    """A deliberate error in reshard's order table (q_layernorm and k_layernorm, one size, in each other's place)
    leaves every bucket length right; the check refuses the conversion, naming both norms."""
    order = list(LAYER_ORDERS[("local", MULTI_HEAD)])
    q, k = order.index("self_attention.q_layernorm.weight"), order.index("self_attention.k_layernorm.weight")
    order[q], order[k] = order[k], order[q]
    monkeypatch.setitem(LAYER_ORDERS, ("local", MULTI_HEAD), tuple(order))
    with pytest.raises(ReshardError) as refused:
        convert(distrib_optim("tiny-odd", tp=2)["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    assert str(refused.value).startswith("decoder.layers.self_attention.k_layernorm.weight: the fp32 master weights decoded")
    assert "2 parameter(s) disagree" in str(refused.value)
    assert not (tmp_path / "out").exists()
