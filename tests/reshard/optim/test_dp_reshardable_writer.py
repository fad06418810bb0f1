"""`reshard convert --optimizer-form dp_reshardable`: the DistributedOptimizer's flat buckets for a new layout,
against Megatron-Core's own: the same state loaded at that layout by Megatron's DistributedOptimizer from its
fully_reshardable save and saved again as dp_reshardable (fixtures/distrib_optim_resave.py). Every bucket tensor
must hold what Megatron wrote, bit for bit, wherever Megatron's own buffers put a parameter (their `param_index_map`,
dumped by the fixture), and zeros in the alignment padding between (where Megatron's save holds uninitialized
memory); every per-rank object and common.pt's optimizer entry must be Megatron's. Both sides are read with torch's
own DCP reader.

tiny-odd-tied at PP2 has alignment gaps and its tied embedding's buckets of their own on both stages; bf16 runs
keep fp32 master weights with gradients reduced in fp32 (dtype_(torch.bfloat16, torch.float32)). tiny-moe (4 experts)
trained at EP2 DP4 is written at EP4, PP2 EP2 and EP2 DP2 as megatron-core's ChainedOptimizer (`chained_0.` dense,
`chained_1.` experts padded for the expert DP size), and at EP1 as its one optimizer with the experts in the dense
buffer; at TP2 EP2 with expert TP 2 (expert DP 1) and, in bf16, expert TP 1 (expert DP 2: the experts' second TP rank
is a data-parallel replica in the expert optimizer). tiny-llama trained in buckets of 10000 elements
(overlap_grad_reduce) is written at PP2 VPP2: each model chunk its own buffer (gbuf_idx_<chunk>), the first stage's
first chunk in buckets of the size the source's args record (reshard carries the source run's bucket size; a target
run with another one refuses the load on per_bucket_numel_unpadded). Every case also shows a one-alignment shift of
a bucket noticed. Transformer-Engine names are written in the TE spec's buffer order: against Megatron's DDP laying its
buffers out in that order (fixtures/distrib_optim_checkpoint.py `te_named_parameters`, as tests/reshard/formats/
test_te_order.py proves the reader; what it proves and does not is said there), tiny-odd TP2 -> PP2 and tiny-moe
EP2 DP4 (grouped experts) -> EP2 DP2; the same sources written in the local order are not Megatron's."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from reshard.optim.dp_reshardable import is_dp_reshardable
from tests.launch import run
from tests.reshard.optim.test_dp_reshardable import assert_same, optimizer_tensors
from tests.reshard.test_cli import _one_line_error, reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

ITER = "iter_0000002"


def saved_state(iter_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, object], dict, object]:
    """The optimizer's tensors and ShardedObjects in `iter_dir` as torch reads them, common.pt's optimizer entry and args."""
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(iter_dir))
    metadata = reader.read_metadata()
    tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
               if is_dp_reshardable(k) and hasattr(v, "size")}
    load(tensors, storage_reader=reader)
    objects = {}
    for key, storage in metadata.storage_data.items():
        if key.offset is None and is_dp_reshardable(key.fqn):
            with open(iter_dir / storage.relative_path, "rb") as f:
                f.seek(storage.offset)
                objects[key.fqn] = torch.load(io.BytesIO(f.read(storage.length)), weights_only=False)
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    return tensors, objects, common["optimizer"], common["args"]


def differences(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], ranges: dict[str, list]) -> list[str]:
    """Bucket tensors of `mine` that differ from Megatron's (`theirs`) where a parameter lies, or hold other than zeros
    in the padding."""
    out = []
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and mine[key].shape == value.shape, key
        params = torch.zeros(value.numel(), dtype=torch.bool)
        for start, end in ranges[key.rsplit(".", 1)[0]]:
            params[start:end] = True
        assert params.sum() > 0.9 * value.numel()
        differ = int((mine[key][params] != value[params]).sum())
        if differ or mine[key][~params].any():
            out.append(f"{key}: {differ} of {int(params.sum())} parameter values differ")
    return out


@dataclass(frozen=True)
class Case:
    """A `distrib_optim` source (preset trained at TP `tp` PP `pp` EP `ep` on 4 ranks) written at a target layout."""

    preset: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    bf16: bool = False
    bucket_size: int | None = None  # the source run's (carried to the target by its args)
    te_order: bool = False  # Transformer-Engine parameter order (the source's args say transformer_engine)
    to_tp: int = 1
    to_pp: int = 1
    to_ep: int = 1
    to_etp: int | None = None  # None: the target TP
    to_vpp: int = 1
    dp: int = 4

    def source(self, distrib_optim, buckets: bool = True) -> dict[str, Path]:
        """The source saves; without `buckets`, the same run's state trained without them."""
        return distrib_optim(self.preset, tp=self.tp, pp=self.pp, bf16=self.bf16, ep=self.ep,
                             bucket_size=self.bucket_size if buckets else None, te_order=self.te_order)

    def convert_args(self) -> list:
        return ["--to-tp", self.to_tp, "--to-pp", self.to_pp, "--to-ep", self.to_ep, "--to-vpp", self.to_vpp,
                *(["--to-etp", self.to_etp] if self.to_etp else []), "--optimizer-form", "dp_reshardable", "--to-dp", self.dp]


@pytest.fixture(scope="module")
def resaved(distrib_optim, tmp_path_factory):
    """resaved(case) -> Megatron's dp_reshardable save of the case's source state at its target layout and DP (ranks:
    TP x PP x DP), and where Megatron put each parameter in its buckets. Megatron loads the state from the source run's
    fully_reshardable save trained without buckets: megatron-core 0.15-0.19 saves a buffer of several buckets shifted
    in that form (an upstream bug, reshard/optim/master_weights.py), and the same run trained in buckets holds the same state
    bit for bit (each gradient element is the same sum; the test asserts it)."""
    cache = {}

    def made(case: Case):
        if case not in cache:
            out = tmp_path_factory.mktemp("resaved")
            full = case.source(distrib_optim, buckets=False)["full"] / ITER
            layout = ["--tp", case.to_tp, "--pp", case.to_pp, "--ep", case.to_ep, "--vpp", case.to_vpp,
                      *(["--etp", case.to_etp] if case.to_etp else [])]
            extra = (["--bf16"] if case.bf16 else []) + (["--te-order"] if case.te_order else [])
            extra += [] if case.bucket_size is None else ["--bucket-size", case.bucket_size]
            run("fixtures.distrib_optim_resave", ["--preset", case.preset, *layout, "--load", full, "--out", out, *extra],
                nproc=case.to_tp * case.to_pp * case.dp, timeout=600)
            ranges = {}
            for path in sorted(out.glob("param_ranges_*.json")):
                ranges.update(json.loads(path.read_text()))
            cache[case] = out / ITER, ranges
        return cache[case]

    return made


CASES = {
    "tiny-llama-tp2dp2-to-tp1pp2dp2": Case("tiny-llama", tp=2, to_pp=2, dp=2),
    "tiny-llama-tp2dp2-to-dp4": Case("tiny-llama", tp=2),
    "tiny-odd-tied-tp2-to-pp2": Case("tiny-odd-tied", tp=2, to_pp=2, dp=2),
    "tiny-odd-bf16-tp2-to-pp2": Case("tiny-odd", tp=2, bf16=True, to_pp=2, dp=2),
    # EP2 DP4 -> EP1: one optimizer, the experts in the dense buffer
    "tiny-moe-ep2dp4-to-ep1": Case("tiny-moe", ep=2),
    "tiny-moe-ep2dp4-to-ep4": Case("tiny-moe", ep=2, to_ep=4),  # expert DP 1
    "tiny-moe-ep2dp4-to-pp2ep2dp2": Case("tiny-moe", ep=2, to_pp=2, to_ep=2, dp=2),  # two stages' chained optimizers
    "tiny-moe-ep2dp4-to-ep2dp2": Case("tiny-moe", ep=2, to_ep=2, dp=2),  # the same EP, another (expert) DP
    # expert TP: ETP = TP 2 (expert DP 1), and ETP 1 (expert DP 2, experts whole on both TP ranks) in bf16
    "tiny-moe-ep2dp4-to-tp2ep2dp2": Case("tiny-moe", ep=2, to_tp=2, to_ep=2, dp=2),
    "tiny-moe-bf16-ep2dp4-to-tp2etp1ep2dp2": Case("tiny-moe", ep=2, bf16=True, to_tp=2, to_ep=2, to_etp=1, dp=2),
    # each model chunk its own buffer, the first stage's first chunk in buckets of the source run's size
    "tiny-llama-buckets-tp2dp2-to-pp2vpp2dp2": Case("tiny-llama", tp=2, bucket_size=10_000, to_pp=2, to_vpp=2, dp=2),
    # the Transformer-Engine spec's order (its norms in linear_qkv and fc1; grouped experts), written with its names
    "tiny-odd-te-tp2-to-pp2": Case("tiny-odd", tp=2, te_order=True, to_pp=2, dp=2),
    "tiny-moe-te-ep2dp4-to-ep2dp2": Case("tiny-moe", ep=2, te_order=True, to_ep=2, dp=2),
    # GLM-4.5 in small: q/k/v biases, q/k norms, an MTP layer after the final norm, no place for the expert_bias buffer
    "tiny-glm4-moe-tp2ep2dp2-to-ep2dp4": Case("tiny-glm4-moe", tp=2, ep=2, to_ep=2),
}


# fast: the first case, the one test of the dp_reshardable writer in the fast tier
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.fast if i == 0 else ()) for i, c in enumerate(CASES.values())], ids=CASES.keys())
def test_written_buckets_are_megatrons_own_at_the_new_layout(distrib_optim, resaved, tmp_path, case):
    out = reshard("convert", case.source(distrib_optim)["dp"], tmp_path / "out", *case.convert_args())
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    if case.bucket_size is not None:  # the run in buckets is the one Megatron loads, without
        assert_same(optimizer_tensors(case.source(distrib_optim)["dp"])[0], optimizer_tensors(case.source(distrib_optim, buckets=False)["full"])[0])
    mine, my_objects, my_common, my_args = saved_state(tmp_path / "out" / ITER)
    resaved_dir, ranges = resaved(case)
    theirs, their_objects, their_common, _ = saved_state(resaved_dir)
    chained = case.to_ep > 1
    prefixes = ("chained_0.", "chained_1.") if chained else ("",)
    assert {k[: k.index("optimizer.distributed.")] for k in theirs} == set(prefixes)
    assert sorted(mine) == sorted(theirs)
    assert {k.rsplit(".", 1)[0] for k in theirs} == set(ranges)
    assert differences(mine, theirs, ranges) == []
    # control: the same output with its last bucket (the experts', the last stage's or chunk's) shifted by one
    # parameter alignment (64 elements) differs from Megatron's
    shifted = max(k for k in theirs if k.endswith(".exp_avg"))
    assert [d.split(":")[0] for d in differences({**mine, shifted: torch.roll(mine[shifted], 64)}, theirs, ranges)] == [shifted]
    assert my_objects == their_objects  # per_bucket_numel(_unpadded) and param_groups of every model-parallel rank
    form = {"param_state_sharding_type": "dp_reshardable"}
    assert my_common == their_common == ({0: form, 1: form} if chained else form)
    assert (my_args.data_parallel_size, my_args.world_size, my_args.use_distributed_optimizer) == (case.dp, case.to_tp * case.to_pp * case.dp, True)
    assert (my_args.tensor_model_parallel_size, my_args.pipeline_model_parallel_size) == (case.to_tp, case.to_pp)
    assert my_args.expert_model_parallel_size == case.to_ep


def test_megatrons_own_ep1_moe_save_decodes_as_its_source(distrib_optim, resaved):
    """The reader side of EP1: Megatron's own dp_reshardable save of tiny-moe at EP1 (one optimizer, no chain, the
    experts after each layer's router in the dense buffer) decodes bit for bit as the EP2 fully_reshardable save it
    was loaded from."""
    resaved_dir, ranges = resaved(CASES["tiny-moe-ep2dp4-to-ep1"])
    assert all(not k.startswith("chained_") for k in ranges)
    got, _ = optimizer_tensors(resaved_dir.parent)
    want, _ = optimizer_tensors(distrib_optim("tiny-moe", tp=1, ep=2)["full"])
    assert len(got) == 3 * 10
    assert_same(got, want)


@pytest.mark.parametrize("name, noticed_by", [("tiny-odd-te-tp2-to-pp2", "bucket lengths"), ("tiny-moe-te-ep2dp4-to-ep2dp2", "values")])
def test_the_local_order_is_not_megatrons_te_order(distrib_optim, resaved, tmp_path, name, noticed_by):
    """Control for the Transformer-Engine cases: the same source written with local-spec names, in the local spec's
    buffer order (its own norms; SequentialMLP experts), differs from Megatron's TE-ordered save: tiny-odd's sizes are
    not multiples of 64, so the other order moves the alignment gaps and the buckets' lengths; tiny-moe's values move
    in the dense and the expert buckets."""
    case = CASES[name]
    out = reshard("convert", case.source(distrib_optim)["dp"], tmp_path / "out", *case.convert_args(), "--naming", "local")
    assert out.returncode == 0, out.stderr
    mine, my_objects, _, _ = saved_state(tmp_path / "out" / ITER)
    resaved_dir, ranges = resaved(case)
    theirs, their_objects, _, _ = saved_state(resaved_dir)
    assert sorted(mine) == sorted(theirs)
    lengths_differ = [k for k in theirs if mine[k].shape != theirs[k].shape]
    if noticed_by == "bucket lengths":
        assert lengths_differ and my_objects != their_objects
    else:
        assert not lengths_differ
        differ = [d.split(":")[0] for d in differences(mine, theirs, ranges)]
        assert any(k.startswith("chained_0.") for k in differ) and any(k.startswith("chained_1.") for k in differ)


@pytest.mark.parametrize("flags, words", [
    (["--to-dp", "4"], ["--to-dp", "--optimizer-form dp_reshardable"]),
    (["--optimizer-form", "dp_reshardable", "--no-optimizer"], ["drop --no-optimizer"]),
    (["--optimizer-form", "dp_reshardable", "--to-format", "zarr"], ["torch_dist or verl form", "zarr"]),
])
def test_a_request_it_cannot_write_is_refused_in_one_line(distrib_optim, tmp_path, flags, words):
    source = distrib_optim("tiny-llama", tp=2, pp=1, bf16=False)["dp"]
    _one_line_error(reshard("convert", source, tmp_path / "out", *flags), *words)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_dry_run_shows_the_optimizer_work(distrib_optim, tmp_path):
    source = distrib_optim("tiny-llama", tp=2, pp=1, bf16=False)["dp"]
    out = reshard("convert", source, tmp_path / "out", "--to-tp", 1, "--optimizer-form", "dp_reshardable", "--to-dp", 4, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "optimizer state: dp_reshardable buckets (DP 2) -> dp_reshardable buckets (DP 4), 2.1 MiB" in out.stdout, out.stdout
    assert not (tmp_path / "out").exists()


def test_moe_requests_it_cannot_write_are_refused_in_one_line(distrib_optim, tmp_path):
    """An expert DP size that does not divide, and a chained expert optimizer from a source with one optimizer
    (reshard's own EP1 output: no expert param_groups recorded) are refused at planning; nothing is written."""
    source = distrib_optim("tiny-moe", tp=1, ep=2)["dp"]
    _one_line_error(reshard("convert", source, tmp_path / "out", "--to-ep", 4, "--optimizer-form", "dp_reshardable", "--to-dp", 2),
                    "data-parallel size 2 x TP 1", "ETP 1 x EP 4", "--to-dp")
    assert not (tmp_path / "out").exists()
    out = reshard("convert", source, tmp_path / "ep1", "--to-ep", 1, "--optimizer-form", "dp_reshardable")
    assert out.returncode == 0, out.stderr
    _one_line_error(reshard("convert", tmp_path / "ep1", tmp_path / "out", "--to-ep", 2, "--optimizer-form", "dp_reshardable"),
                    "EP > 1", "chained expert optimizer", "fully_reshardable")
    assert not (tmp_path / "out").exists()


def test_dry_run_shows_the_moe_optimizer_work(distrib_optim, tmp_path):
    source = distrib_optim("tiny-moe", tp=1, ep=2)["dp"]
    out = reshard("convert", source, tmp_path / "out", "--to-ep", 4, "--to-pp", 2, "--optimizer-form", "dp_reshardable", "--to-dp", 4,
                  "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "optimizer state: dp_reshardable buckets (DP 4) -> dp_reshardable buckets (DP 4), 3.2 MiB" in out.stdout, out.stdout
    assert not (tmp_path / "out").exists()
