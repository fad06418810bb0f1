"""Megatron-LM's integrity.json (megatron-core >= 0.18): checked on read, and a correct one written with the copy.

The manifests here are written as Megatron-LM's `save_integrity_manifest` writes them (validation.py: the sha256
of each file directly in the iteration directory, `{"algorithm": "sha256", "files": {...}}`), with `hashlib`;
the output's is checked the same way, and by what Megatron-LM's `_verify_integrity_manifest_impl` requires."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import write_synthetic
from reshard.layout import Layout
from tests.cli import refused_by_every_command, run_cli

ITER = "iter_0000010"


def megatron_manifest(directory) -> dict:
    """What Megatron-LM writes: every file directly in the directory but the manifest, by name, sorted."""
    files = sorted(e.name for e in os.scandir(directory) if e.is_file() and e.name != "integrity.json")
    return {"algorithm": "sha256", "files": {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in files}}


@pytest.fixture
def source(tmp_path):
    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist", dtype="float32", optimizer=True)
    directory = tmp_path / "src" / ITER
    (directory / "integrity.json").write_text(json.dumps(megatron_manifest(directory), indent=2))
    return tmp_path / "src"


@pytest.mark.parametrize("to", [["--to-tp", 1], []], ids=["tp2->tp1", "same-layout"])
def test_a_copy_gets_a_manifest_of_its_own_that_megatron_lm_accepts(source, tmp_path, monkeypatch, capsys, to):
    """Every file of the copy is listed with its own digest (the source's manifest, copied, would be wrong: the
    copy's files differ), the manifest lists nothing that is not there, and reshard reads the copy back."""
    code, _ = run_cli(monkeypatch, capsys, "convert", source, tmp_path / "dst", *to, "-q")
    assert code == 0
    written = tmp_path / "dst" / ITER
    manifest = json.loads((written / "integrity.json").read_text())
    assert manifest == megatron_manifest(written)
    assert {".metadata", "common.pt", "__0_0.distcp"} <= set(manifest["files"])
    assert manifest["files"] != json.loads((source / ITER / "integrity.json").read_text())["files"]
    assert run_cli(monkeypatch, capsys, "verify", tmp_path / "dst")[0] == 0


def test_a_source_without_one_gives_a_copy_without_one(source, tmp_path, monkeypatch, capsys):
    """Megatron-LM writes one only when asked (`--verify-integrity`); reshard keeps the source's choice."""
    (source / ITER / "integrity.json").unlink()
    assert run_cli(monkeypatch, capsys, "convert", source, tmp_path / "dst", "--to-tp", 1, "-q")[0] == 0
    assert not (tmp_path / "dst" / ITER / "integrity.json").exists()


def _append(directory, name):
    with open(directory / name, "ab") as f:
        f.write(b"\0")


def _edit_manifest(change):
    def edit(directory, _):
        manifest = json.loads((directory / "integrity.json").read_text())
        change(manifest)
        (directory / "integrity.json").write_text(json.dumps(manifest))
    return edit


@pytest.mark.parametrize("damage,words", [
    (lambda d, _: _append(d, "__1_0.distcp"), ("__1_0.distcp does not match its sha256",)),
    (lambda d, _: _append(d, "common.pt"), ("common.pt does not match its sha256",)),
    (lambda d, _: (d / "__1_0.distcp").rename(d / "moved"), ("__1_0.distcp is listed in integrity.json but missing",)),
    (_edit_manifest(lambda m: m["files"].pop("__0_0.distcp")), ("does not cover __0_0.distcp",)),
    (_edit_manifest(lambda m: m.update(algorithm="md5")), ("hashes with 'md5'",)),
    (_edit_manifest(lambda m: m["files"].update({"../outside": "0" * 64})), ("'../outside'", "not a file of")),
    (_edit_manifest(lambda m: m["files"].update({"/etc/passwd": "0" * 64})), ("'/etc/passwd'", "not a file of")),
    (_edit_manifest(lambda m: m["files"].update({"common.pt": "not hex"})), ("not a sha256 in hex",)),
    (_edit_manifest(lambda m: m.pop("files")), ("not Megatron-LM's integrity manifest",)),
    (lambda d, _: (d / "integrity.json").write_text("{"), ("cannot be read as JSON",)),
], ids=["distcp-changed", "common-changed", "file-missing", "file-not-covered", "md5", "dotdot", "absolute", "bad-digest",
        "no-files", "not-json"])
def test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused(source, tmp_path, monkeypatch, capsys, damage, words):
    damage(source / ITER, tmp_path)
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "dst", *words, to=("--to-tp", "1"))


def test_a_symlink_the_manifest_lists_may_not_lead_outside(source, tmp_path, monkeypatch, capsys):
    (tmp_path / "secret").write_bytes(b"x")
    os.symlink(tmp_path / "secret", source / ITER / "extra")
    _edit_manifest(lambda m: m["files"].update({"extra": hashlib.sha256(b"x").hexdigest()}))(source / ITER, None)
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "dst", "leads outside the checkpoint", to=("--to-tp", "1"))
