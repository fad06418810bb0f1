"""Session fixtures shared by every test that needs Megatron-made checkpoints or the oracle."""

from __future__ import annotations

import pytest
import torch

from tests.bridge import hybrid_imports
from tests.cache import built
from tests.launch import run
from tests.megatron import ORACLE, layout_args, make_checkpoints


@pytest.fixture(scope="session")
def dense(tmp_path_factory):
    """tiny-llama: base TP1PP1 (with one Adam step), TP2PP1 and TP1PP2 torch_dist, legacy TP2."""
    return built(
        tmp_path_factory,
        make_checkpoints,
        "tiny-llama",
        [
            ("tp2", dict(tp=2), ["--optimizer"]),
            ("pp2", dict(pp=2), ["--optimizer"]),
            ("legacy_tp2", dict(tp=2), ["--format", "legacy"]),
        ],
    )


@pytest.fixture(scope="session")
def moe(tmp_path_factory):
    """tiny-moe: base and EP2 torch_dist (Megatron's own reshard), with Adam state."""
    return built(tmp_path_factory, make_checkpoints, "tiny-moe", [("ep2", dict(ep=2), ["--optimizer"])])


@pytest.fixture(scope="session")
def bridge_hybrids(tmp_path_factory):
    """Megatron-Bridge's own imports of the tiny hybrid models and its exports of reshard's (`tests.bridge.hybrid_imports`)."""
    return built(tmp_path_factory, hybrid_imports)


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    """oracle(ckpt, tp=.., pp=..) -> {'loss', 'logits'}: Megatron-Core loads `ckpt` strictly at that layout."""
    root = tmp_path_factory.mktemp("oracle")
    cache = {}

    def result(ckpt, **layout):
        key = (str(ckpt), tuple(sorted(layout.items())))
        if key not in cache:
            out = root / f"r{len(cache)}.pt"
            nproc = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)
            run(ORACLE, ["--load", ckpt, *layout_args(**layout), "--out", out], nproc=nproc)
            cache[key] = torch.load(out, weights_only=False)
        return cache[key]

    return result



@pytest.fixture(scope="session")
def distrib_optim(tmp_path_factory):
    """distrib_optim(preset, tp=.., pp=.., vpp=1, bucket_size=None, bf16=False, ep=1, te_order=False, etp=None) -> {'dp': dp_reshardable,
    'full':
    fully_reshardable, 'legacy': Megatron-LM's --ckpt-format torch (model_optim_rng.pt and megatron-core's own
    distrib_optim.pt)}: the preset trained two steps by Megatron-Core's DistributedOptimizer on 4 ranks (gloo, CPU;
    DP = 4 / (TP x PP), experts over EP of them; with `bucket_size`, gradients reduced in overlapped buckets of about that many elements;
    `bf16`: bf16 parameters, fp32 master weights and grads; `te_order`: its buffers in the Transformer-Engine spec's parameter
    order; `etp`: expert tensor parallelism; fixtures/distrib_optim_checkpoint.py), the same state saved in both forms. Made once per
    test run per argument set (tests/cache.py)."""

    def made(preset="tiny-llama", tp=2, pp=1, vpp=1, bucket_size=None, bf16=False, ep=1, te_order=False, etp=None):
        return built(tmp_path_factory, trained_distrib_optim, preset, tp, pp, vpp, bucket_size, bf16, ep, te_order, etp)

    return made


def trained_distrib_optim(out, preset, tp, pp, vpp, bucket_size, bf16, ep, te_order, etp=None) -> dict:
    """The `distrib_optim` fixture's run, saved under `out`."""
    made = {"dp": out / "dp", "full": out / "full", "legacy": out / "legacy"}
    extra = ([] if bucket_size is None else ["--bucket-size", bucket_size]) + (["--bf16"] if bf16 else [])
    extra += ["--te-order"] if te_order else []
    extra += ["--etp", etp] if etp else []
    run("fixtures.distrib_optim_checkpoint", ["--preset", preset, "--tp", tp, "--pp", pp, "--vpp", vpp, "--ep", ep, "--steps", 2, *extra,
                                              "--dp-out", made["dp"], "--full-out", made["full"], "--legacy-out", made["legacy"]],
        nproc=4, timeout=600)
    return made
