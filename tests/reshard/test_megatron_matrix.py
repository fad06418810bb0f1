"""The proof of issue 2: what reshard writes, Megatron-Core loads, and it computes the same loss.

Sources are saved by megatron-core itself (tests/megatron.py); each is converted by reshard to a
target layout and format, then loaded strictly into GPTModel at that layout by the oracle, whose
loss and logits must equal the unconverted model's (fp32: loss within 1e-6 relative).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from reshard.convert import convert
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from reshard.request import Target
from reshard.verify import compare, compute_checksums
from tests.megatron import make_checkpoints, same

pytestmark = pytest.mark.slow  # every test loads Megatron-made checkpoints into Megatron-Core; one case is kept in the fast tier


def _convert(source, target, to_format=None, optimizer=True, **layout):
    convert(source, target, Target(format=to_format, layout=Layout(**layout), optimizer=optimizer))
    return target


# (source fixture, target format, target layout): each pair is one reshard + one Megatron load.
DENSE_MATRIX = [
    ("tp2", "torch_dist", dict(tp=1)),
    ("tp2", "torch_dist", dict(tp=1, pp=2)),
    ("pp2", "torch_dist", dict(tp=2)),
    ("tp2", "legacy", dict(tp=1, pp=2)),
    ("tp2", "legacy", dict(tp=2, pp=2)),
    ("legacy_tp2", "torch_dist", dict(tp=1)),
    ("legacy_tp2", "legacy", dict(pp=2, vpp=2)),
    ("legacy_tp2", "legacy", dict(pp=2, first_stage_layers=1)),
]


# The fast tier keeps the first: Megatron's own TP2 save, converted to TP1 and loaded by dist_checkpointing.load.
@pytest.mark.parametrize("source, fmt, layout", [pytest.param(*c, marks=pytest.mark.fast if i == 0 else ()) for i, c in enumerate(DENSE_MATRIX)],
                         ids=[f"{s}-to-{f}-{Layout(**sizes)}" for s, f, sizes in DENSE_MATRIX])
def test_dense_reshard_loads_in_megatron_with_the_same_loss(dense, oracle, tmp_path, source, fmt, layout):
    target = _convert(dense[source], tmp_path / "out", to_format=fmt, optimizer=fmt != "legacy", **layout)
    same(oracle(dense["base"]), oracle(target, **layout))


def test_moe_expert_parallel_reshard(moe, oracle, tmp_path):
    ep1 = _convert(moe["ep2"], tmp_path / "ep1", ep=1)
    same(oracle(moe["base"]), oracle(ep1))
    legacy = _convert(moe["base"], tmp_path / "legacy_ep2", to_format="legacy", optimizer=False, ep=2)
    same(oracle(moe["base"]), oracle(legacy, ep=2))


def test_conversions_never_import_torch(moe, oracle, tmp_path):
    """Every format reads and writes torch's files without torch (its import was a fifth of a 3 GB
    conversion): an EP reshard of Megatron's own checkpoint (Adam state, RNG and extra states), then through
    legacy and zarr and back, run by the CLI in a process that must end with no torch module loaded;
    Megatron-Core then loads the result with the source's loss."""
    steps = [
        ["convert", str(moe["ep2"]), str(tmp_path / "ep1"), "--to-ep", "1", "-q"],
        ["convert", str(tmp_path / "ep1"), str(tmp_path / "legacy"), "--to-format", "legacy", "--to-ep", "2", "--no-optimizer", "-q"],
        ["convert", str(tmp_path / "legacy"), str(tmp_path / "z"), "--to-format", "zarr", "-q"],
        ["convert", str(tmp_path / "z"), str(tmp_path / "back"), "--to-format", "torch_dist", "--to-ep", "2", "-q"],
    ]
    script = (
        "import sys\nfrom reshard.cli import main\n"
        f"for args in {steps!r}:\n    main(args, standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    same(oracle(moe["base"]), oracle(tmp_path / "back", ep=2))


def test_tp4_with_grouped_query_attention(tmp_path_factory, oracle, tmp_path):
    gqa = make_checkpoints(tmp_path_factory.mktemp("gqa4"), "tiny-gqa4", [], optimizer=False)
    tp4 = _convert(gqa["base"], tmp_path / "tp4", tp=4)  # 4 query groups, one per rank
    same(oracle(gqa["base"]), oracle(tp4, tp=4))


def test_vocabulary_repadded_for_tp4(tmp_path_factory, oracle, tmp_path):
    """250 tokens pad to 256 rows at TP1 but 512 at TP4 (128 x 4): the logits over the real
    vocabulary must not change (Megatron's loss does, as it also sums over padding rows)."""
    gqa = make_checkpoints(tmp_path_factory.mktemp("gqa4pad"), "tiny-gqa4-pad128", [], optimizer=False)
    tp4 = _convert(gqa["base"], tmp_path / "tp4", tp=4)
    with open_checkpoint(tp4) as reader:
        assert reader.config.padded_vocab_size == 512
    same(oracle(gqa["base"]), oracle(tp4, tp=4), loss=False)
    back = _convert(tp4, tmp_path / "tp1", tp=1)  # and back to 256 rows: the loss is exact again
    same(oracle(gqa["base"]), oracle(back))


def test_tied_embeddings_over_pipeline_stages(tmp_path_factory, oracle, tmp_path):
    tied = make_checkpoints(tmp_path_factory.mktemp("tied"), "tiny-tied", [], optimizer=False)
    pp2 = _convert(tied["base"], tmp_path / "pp2", to_format="legacy", pp=2)  # last stage gets its output_layer copy
    same(oracle(tied["base"]), oracle(pp2, pp=2))


def _checksums(path):
    with open_checkpoint(path) as reader:
        return compute_checksums(reader)


def test_checksums_equal_across_layouts_megatron_saved(dense, moe):
    """Megatron sharded these itself; our readers must see one logical model (optimizer included)."""
    base = _checksums(dense["base"])
    assert any(name.startswith("optimizer.state.exp_avg_sq.") for name in base)
    for name in ("tp2", "pp2"):
        assert compare(_checksums(dense[name]), base).ok, name
    legacy = _checksums(dense["legacy_tp2"])  # no optimizer in the legacy copy
    result = compare(legacy, base, subset=True)
    assert result.ok and result.matched == len(legacy) > 5
    assert compare(_checksums(moe["ep2"]), _checksums(moe["base"])).ok


def test_flipped_bit_in_a_megatron_shard_is_detected(dense, tmp_path):
    import shutil

    from reshard.formats.megatron_dist import TorchDistReader

    copy = tmp_path / "copy"
    shutil.copytree(dense["tp2"], copy)
    reader = TorchDistReader(copy)
    name = "decoder.layers.mlp.linear_fc2.weight"
    values = reader.read(name, ((1, 2), (0, 64), (64, 128)))  # TP rank 1's share of layer 1
    for shard in (copy / "iter_0000001").glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        at = data.find(values.tobytes())
        if at >= 0:
            data[at + 3] ^= 0x01
            shard.write_bytes(bytes(data))
            break
    else:
        raise AssertionError("shard bytes not found")
    result = compare(_checksums(copy), _checksums(dense["base"]))
    assert result.mismatched == [name]
