"""The `reshard` command: a thin layer over `reshard.convert`, `reshard.verify` and `reshard.inspect`."""

from __future__ import annotations

import errno
import gc
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from reshard.errors import ReshardError
from reshard.logical import PRECISIONS

if TYPE_CHECKING:
    from reshard.convert import ConversionResult
    from reshard.request import Run, Target

FORMATS = ["torch_dist", "legacy", "zarr", "hf", "verl", "peft"]  # peft: a LoRA adapter save's adapter alone (`reshard.lora`)

# Each thread waits on the disk about half the time (a read, then a write, of every unit), so two per core
# keep the cores busier (benchmarks/README.md, "Measurements behind defaults").
DEFAULT_WORKERS = min(8, 2 * (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _progress_bar(label: str, quiet: bool) -> Any:
    """A bar in bytes, whose total is set once the plan is known (`convert(planned=...)`)."""
    from tqdm import tqdm

    return tqdm(total=None, unit="B", unit_scale=True, desc=label, disable=quiet or not sys.stderr.isatty(), leave=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="reshard")
def main() -> None:
    """Reshape Megatron-Core checkpoints across TP/PP/EP and convert between formats."""


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--config", "config_file", type=click.Path(path_type=Path),
              help="The architecture of a torch_dist checkpoint that records none: an HF config.json or a YAML of Megatron arguments.")
def inspect(path: Path, as_json: bool, config_file: Path | None) -> None:
    """Show what a checkpoint is: format, architecture, layout, tensors and bytes."""
    from reshard.inspect import inspect as do_inspect

    info = do_inspect(path, config_file)
    click.echo(json.dumps(info.to_json(), indent=1) if as_json else info.render())


@main.command()
@click.argument("source")
@click.argument("destination", type=click.Path(path_type=Path))
@click.option("--tp", type=int, help="Assert the source's tensor-parallel degree.")
@click.option("--pp", type=int, help="Assert the source's pipeline-parallel degree.")
@click.option("--ep", type=int, help="Assert the source's expert-parallel degree.")
@click.option("--to-tp", type=int, help="Target tensor-parallel degree (default: the source's).")
@click.option("--to-pp", type=int, help="Target pipeline-parallel degree.")
@click.option("--to-ep", type=int, help="Target expert-parallel degree.")
@click.option("--to-etp", type=int, help="Target expert tensor-parallel degree (default: the target TP).")
@click.option("--to-vpp", type=int, help="Target virtual pipeline stages per pipeline rank.")
@click.option("--first-stage-layers", type=int, help="Layers on the first pipeline stage (uneven pipelines).")
@click.option("--last-stage-layers", type=int, help="Layers on the last pipeline stage (uneven pipelines).")
@click.option("--to-format", type=click.Choice(FORMATS), help="Target format (default: the source's; a NeMo-RL step is written back as one).")
@click.option("--no-optimizer", is_flag=True, help="Drop optimizer state instead of resharding it.")
@click.option("--optimizer-form", type=click.Choice(["fully_reshardable", "dp_reshardable"]), default="fully_reshardable",
              show_default=True,
              help="torch_dist output: the DistributedOptimizer state per parameter (loads at any layout), or as the flat "
              "buckets of the target layout's DistributedOptimizer (Megatron-LM's default form; loads at that TP/PP/EP, any DP).")
@click.option("--to-dp", type=int,
              help="dp_reshardable or legacy (distrib_optim.pt) output: the data-parallel size of the run that resumes it (default: the source's).")
@click.option("--vocab-size", type=int, help="The true vocabulary size, when the checkpoint does not record it.")
@click.option("--config", "config_file", type=click.Path(path_type=Path),
              help="The architecture of a torch_dist checkpoint that records none: an HF config.json or a YAML of Megatron arguments.")
@click.option("--base", type=click.Path(path_type=Path),
              help="SOURCE is a LoRA adapter save (Megatron-Bridge's or NeMo-RL's PEFT, adapter weights only): the model it "
              "adapts (HF or Megatron); the output is that model with the adapter merged.")
@click.option(
    "--naming",
    type=click.Choice(["te", "local"]),
    help="Megatron output: Transformer-Engine or local-spec parameter names (default: the source's transformer_impl).",
)
@click.option(
    "--for",
    "for_tool",
    type=click.Choice(["megatron-lm", "bridge"]),
    default="megatron-lm",
    show_default=True,
    help="torch_dist output for this loader: bridge stores the vocabulary unpadded and a release as iteration 0, "
    "as Megatron-Bridge saves and exports them (Megatron-LM's loader pads the vocabulary itself).",
)
@click.option(
    "--dtype",
    type=click.Choice(list(PRECISIONS)),
    help="store the model's weights in this dtype and record it as the model's precision (default: the "
    "source's); optimizer state is not cast: a change of precision needs --no-optimizer.",
)
@click.option("--to-fp8-blocks", "fp8_blocks", is_flag=True,
              help="HF output: the decoder's linear weights as float8_e4m3fn with a float32 weight_scale_inv per block "
              "(DeepSeek-V3's form; the source's blocks, else 128x128). Lossy: each value is held to the re-quantization "
              "error bound instead of the source's checksums. An fp8 SOURCE is read dequantized, to bf16 unless --dtype.")
@click.option("--to-mxfp4", "mxfp4", is_flag=True,
              help="HF output: the experts' weights as MXFP4 blocks and scales, as gpt-oss is released (other families are "
              "not released so: refused). Lossy: each value is held to MXFP4's error bound; a released MXFP4 model comes back "
              "byte for byte. An MXFP4 SOURCE is read dequantized, to bf16 unless --dtype.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty destination (only after the new one verifies).")
@click.option("--dry-run", is_flag=True, help="Print the plan (files, bytes, peak memory) and write nothing. SOURCE may "
              "then be an HF config.json alone (no weights): the plan of its model, e.g. of a 671B model before downloading it.")
@click.option("--disk-speed", help="With --dry-run: add the least time the conversion takes at this copy speed, in bytes a "
              "second (e.g. 800MB), or 'probe' to measure it with a short parallel copy (256 MiB, removed after) beside DESTINATION.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--workers", type=click.IntRange(1, 64), default=DEFAULT_WORKERS, show_default=True,
              help="Threads reading, hashing and writing units of work (the output does not depend on it).")
@click.option("--max-memory", "max_memory", type=str, default=None,
              help="Working-memory budget for slabs in flight, e.g. 2GiB (default: two of the largest unit of work, a "
              "slab or the part of one the target writes at once, plus, for reading ahead, 64MiB per worker and at least 256MiB, "
              "or an eighth of RAM if less).")
@click.option("--reread", is_flag=True,
              help="Verify by reading every written value back from the disk (default: records the metadata on disk "
              "puts exactly where they were written count with the checksums of their bytes as written).")
@click.option("--no-space-check", is_flag=True,
              help="Do not refuse a conversion whose tensors exceed the destination's free space (for filesystems "
              "that misreport it).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("--token", help="Hub token for a Hub SOURCE (default: HF_TOKEN or the token saved by `hf auth login`).")
@click.option("--endpoint", help="Hub URL for a Hub SOURCE (default: HF_ENDPOINT or https://huggingface.co).")
def convert(source: str, destination: Path, **opts: Any) -> None:
    """Convert SOURCE into DESTINATION at another layout and/or format.

    SOURCE is a local checkpoint, or a model on the Hugging Face Hub: hf://org/model[@revision], or
    org/model[@revision] where no such local path exists. Its config, tokenizer and safetensors files are
    downloaded through the Hugging Face cache (never pickles or code).

    Example: reshard convert ckpts/run1 ckpts/run1-tp8 --tp 4 --to-tp 8
    """
    from reshard.collective import world
    from reshard.convert import convert as do_convert
    from reshard.hub import Access, local_source
    from reshard.request import SourceHints

    speed = opts.pop("disk_speed")
    if speed is not None and not opts["dry_run"]:
        raise ReshardError("--disk-speed is for the time estimate of --dry-run: add --dry-run or drop it")
    say = None if opts["quiet"] or opts["as_json"] or world()[0] else (lambda line: click.echo(line, err=True))
    source = local_source(source, Access(opts.pop("token"), opts.pop("endpoint")), say)  # a Hub repo: downloaded

    # torch's objects are long-lived: keep the collector from walking them again and again mid-stream
    # (a measurable share of a conversion: benchmarks/README.md)
    gc.freeze()

    target = _target(opts)
    rank = world()[0]
    bar = _progress_bar("converting", opts["quiet"] or opts["dry_run"] or rank != 0)
    with bar:
        result = do_convert(
            source,
            destination,
            target,
            hints=SourceHints(tp=opts["tp"], pp=opts["pp"], ep=opts["ep"], vocab_size=opts["vocab_size"], config=opts["config_file"],
                              base=opts["base"]),
            run=_run(opts),
            overwrite=opts["overwrite"],
            dry_run=opts["dry_run"],
            planned=lambda plan: setattr(bar, "total", plan.bytes_moved),  # bytes, as `progress` counts
            progress=lambda n: bar.update(n),
        )
    if rank == 0:  # rank 0 speaks for a multi-rank conversion
        _tell_converted(result, destination, target, opts, None if speed is None else _disk_speed(speed, destination))


def _target(opts: dict[str, Any]) -> Target:
    """`reshard.request.Target` of convert's flags."""
    from reshard.request import LayoutChange, Target

    layout = LayoutChange(tp=opts["to_tp"], pp=opts["to_pp"], ep=opts["to_ep"], etp=opts["to_etp"], vpp=opts["to_vpp"],
                          first_stage_layers=opts["first_stage_layers"], last_stage_layers=opts["last_stage_layers"])
    return Target(format=opts["to_format"], layout=layout, dtype=opts["dtype"], optimizer=not opts["no_optimizer"],
                  naming=opts["naming"], for_bridge=opts["for_tool"] == "bridge", fp8_blocks=opts["fp8_blocks"],
                  mxfp4=opts["mxfp4"], optimizer_form=opts["optimizer_form"], dp=opts["to_dp"])


def _run(opts: dict[str, Any]) -> Run:
    """`reshard.request.Run` of convert's flags."""
    from reshard.request import Run

    return Run(workers=opts["workers"], max_memory=parse_bytes(opts["max_memory"]) if opts["max_memory"] else None,
               reread=opts["reread"], check_space=not opts["no_space_check"])


def _tell_converted(result: ConversionResult, destination: Path, target: Target, opts: dict[str, Any], copy_speed: float | None) -> None:
    """What convert says once done: the plan (--dry-run), the JSON of --json, or a line of what was written."""
    from reshard import fp8_blocks, mxfp4

    # lossy: the bound holds the output to the source, the checksums only to what was stored
    lossy = ("fp8_blocks", "linear weights re-quantized to fp8 blocks", fp8_blocks.BOUND) if target.fp8_blocks else \
        ("mxfp4", "experts' weights re-quantized to MXFP4", mxfp4.BOUND) if target.mxfp4 else None
    plan = result.plan
    if plan is None:
        click.echo(json.dumps({"peft": str(destination), "seconds": round(result.seconds, 3)}) if opts["as_json"]
                   else f"wrote {destination} (PEFT adapter: adapter_config.json, adapter_model.safetensors)")
        return
    if opts["as_json"]:
        out = plan.to_json(copy_speed) | {"seconds": round(result.seconds, 3), "dry_run": opts["dry_run"]}
        if lossy:
            out[lossy[0]] = {"bit_identical": False, "bound": lossy[2]}
        click.echo(json.dumps(out, indent=1))
    elif opts["dry_run"]:
        click.echo(plan.render(copy_speed))
    else:
        rate = plan.bytes_moved / max(result.seconds, 1e-9) / 1e6
        checked = "checksums verified"
        if lossy:
            checked = f"{lossy[1]}, NOT bit-identical: every value within {lossy[2]} of the source, checksums verified against the values stored"
        click.echo(
            f"wrote {destination} ({plan.target_format}, {plan.target_layout}): {len(plan.moves)} tensors, "
            f"{checked}, {result.seconds:.1f} s ({rate:.0f} MB/s)"
        )
        if plan.dropped:
            click.echo(f"not carried: {summarize(plan.dropped)}")


def _disk_speed(text: str, destination: Path) -> float:
    """--disk-speed: bytes a second, given or probed beside the destination (`reshard.disk_speed`)."""
    if text == "probe":
        from reshard.disk_speed import copy_speed

        return copy_speed(destination.parent)
    try:
        speed = parse_bytes(text)
    except ReshardError:
        speed = 0
    if speed <= 0:
        raise ReshardError(f"--disk-speed {text!r} is neither a speed nor 'probe'; write e.g. 800MB (bytes a second) or probe")
    return speed


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--against", type=click.Path(path_type=Path), help="Another checkpoint (any format or layout) to compare with.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--config", "config_file", type=click.Path(path_type=Path),
              help="The architecture of a torch_dist checkpoint that records none: an HF config.json or a YAML of Megatron arguments.")
def verify(path: Path, against: Path | None, as_json: bool, config_file: Path | None) -> None:
    """Recompute PATH's checksums and compare them with the recorded ones or with another checkpoint."""
    from reshard.verify import verify as do_verify

    report = do_verify(path, against, config_file)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        click.echo(f"{path}: {report.comparison.summary()} ({report.reference_label})")
    if not report.comparison.ok:
        sys.exit(1)


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository as private (when it does not exist yet).")
@click.option("--revision", help="Branch to upload to (created from the default branch if missing).")
@click.option("--token", help="Hub token (default: HF_TOKEN or the token saved by `hf auth login`).")
@click.option("--endpoint", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co).")
@click.option("--message", help="Commit message.")
@click.option("--staging", type=click.Path(path_type=Path),
              help="Where a checkpoint that is not an HF model is exported first (default: CHECKPOINT-hf beside it).")
@click.option("--dtype", type=click.Choice(list(PRECISIONS)), help="Export the weights in this dtype (default: the checkpoint's).")
@click.option("--max-shard-size", help="Export in safetensors files of at most this size, e.g. 2GiB (default 5GiB); "
              "an interrupted upload resumes file by file.")
@click.option("--metrics", type=click.Path(path_type=Path),
              help="The trainer's --metrics log: the model card gets the loss at the checkpoint's iteration.")
@click.option("--workers", type=click.IntRange(1, 64), default=DEFAULT_WORKERS, show_default=True,
              help="Threads exporting and hashing.")
@click.option("--commit-size", default="5GiB", show_default=True,
              help="Upload in commits of about this size; a rerun after an interruption resumes at the first file not yet committed.")
@click.option("--allow-code", is_flag=True, help="Upload *.py files and an auto_map (code that transformers runs with "
              "trust_remote_code) too; refused otherwise.")
@click.option("--include-unverified", is_flag=True, help="Publish files no checksum covers too (notes, extra folders: "
              "anything but the weights, the files whose sha256 the export recorded, the manifest and the model card); "
              "refused otherwise, listing them.")
@click.option("-q", "--quiet", is_flag=True, help="No progress.")
def upload(checkpoint: Path, repo_id: str, **opts: Any) -> None:
    """Publish CHECKPOINT to the Hub as REPO_ID, as an HF model whose checksums verify.

    CHECKPOINT is any checkpoint reshard reads: a Megatron training checkpoint is exported to HF first
    (into --staging, reused by a rerun while the checkpoint is unchanged); an HF export of reshard is
    uploaded as it is. Only files the repository lacks are uploaded: run the same command again after an
    interruption. Example: reshard upload ckpts/run1 my-org/my-model --metrics run1.jsonl
    """
    from reshard.upload import upload as do_upload

    sizes = {}
    for option in ("commit_size", "max_shard_size"):
        try:
            sizes[option] = parse_bytes(opts[option]) if opts[option] else None
        except ReshardError:
            sizes[option] = 0
        if sizes[option] == 0:
            flag = "--" + option.replace("_", "-")
            raise ReshardError(f"{flag} {opts[option]!r} is not a size; write e.g. 5GiB")
    say = None if opts["quiet"] else (lambda line: click.echo(line, err=True))
    bar, hashing = _progress_bar("exporting", opts["quiet"]), _progress_bar("hashing", opts["quiet"])

    def hashed(done: int, total: int) -> None:
        hashing.total = total
        hashing.update(done - hashing.n)

    try:
        with bar, hashing:
            result = do_upload(
                checkpoint, repo_id, private=opts["private"], revision=opts["revision"], token=opts["token"],
                endpoint=opts["endpoint"], commit_message=opts["message"], staging=opts["staging"], dtype=opts["dtype"],
                max_shard_bytes=sizes["max_shard_size"], metrics=opts["metrics"], workers=opts["workers"],
                commit_bytes=sizes["commit_size"], report=say, allow_code=opts["allow_code"],
                include_unverified=opts["include_unverified"],
                planned=lambda plan: setattr(bar, "total", plan.bytes_moved), progress=lambda n: bar.update(n), hashed=hashed,
            )
    except KeyboardInterrupt:
        click.echo("reshard: interrupted; run the same command again: it resumes the export where it stopped, and "
                   "uploads only the files the repository lacks", err=True)
        sys.exit(130)
    done = f"{len(result.committed)} committed now, {result.files - len(result.committed)} already in the repository"
    unchecked = f", {len(result.unverified)} of them unverified (--include-unverified)" if result.unverified else ""
    click.echo(f"uploaded {checkpoint} to {result.url}: {result.files} files ({done}{unchecked}), checksums verified before "
               f"upload; every file on the Hub has the sha256 of {result.folder}")


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}


def parse_bytes(text: str) -> int:
    """'2GiB', '512M', '1e9' -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ReshardError(f"--max-memory {text!r} is not a size; write e.g. 2GiB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def summarize(names: list[str]) -> str:
    """'18 optimizer tensors, 2 rng_state objects' rather than a wall of names; an argument (`args.x`) by its name."""
    groups: dict[str, int] = {}
    for name in names:
        if name.startswith("args."):
            kind = name
        elif name.startswith("optimizer"):
            kind = "optimizer state"
        else:
            kind = name.split("/", 1)[0].rsplit(".", 1)[-1]
        groups[kind] = groups.get(kind, 0) + 1
    return ", ".join(f"{count} x {kind}" for kind, count in groups.items())


# The disk refusing a write: the user's to fix, not a bug.
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM}
_AGAIN = "run the same command again: it resumes where it stopped"


def run() -> None:
    """Entry point: one-line errors, never a traceback (RESHARD_DEBUG=1 shows it)."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("reshard: aborted", err=True)
        sys.exit(130)
    except ReshardError as exc:
        if os.environ.get("RESHARD_DEBUG"):
            raise
        click.echo(f"reshard: error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo(f"reshard: interrupted; nothing was written at the destination ({_AGAIN})", err=True)
        sys.exit(130)
    except OSError as exc:
        if exc.errno not in _DISK_ERRORS or os.environ.get("RESHARD_DEBUG"):
            _internal_error(exc)
        click.echo(f"reshard: error: {exc.strerror}: {exc.filename or ''}; nothing was written at the destination "
                   f"(free space or fix the permissions, then {_AGAIN})", err=True)
        sys.exit(1)
    except Exception as exc:
        _internal_error(exc)


def _internal_error(exc: Exception) -> NoReturn:
    """A bug: still one line, with the way to get details."""
    if os.environ.get("RESHARD_DEBUG"):
        raise exc
    click.echo(f"reshard: internal error: {exc.__class__.__name__}: {exc} (rerun with RESHARD_DEBUG=1 for details)", err=True)
    sys.exit(2)
