"""`reshard upload` against a Hub-compatible server on 127.0.0.1, through huggingface_hub's real HfApi."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import SyntheticReader
from fixtures.torchrun import pythonpath
from reshard.cli import main
from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.hub import Access
from reshard.layout import Layout
from reshard.plan import make_plan
from reshard.request import Target
from reshard.streaming import stream
from reshard.upload import RECORD, upload
from tests.cli import tree_digest

from hf_models import build
from hub_server import Hub, isolate

SHARD = 200_000  # bytes: the tiny model's export in four safetensors files


@pytest.fixture(autouse=True)
def hf_home(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path / "hf-home")



@pytest.fixture
def export(tmp_path):
    source = build("qwen2", tmp_path / "src")
    convert(source, tmp_path / "export", Target(format="hf"))
    return tmp_path / "export"


@pytest.fixture
def trained(tmp_path):
    """A torch_dist checkpoint as the trainer saves one (TP2, Adam state, data_state at iteration 10), and the
    run's metrics log, where the iteration appears twice: the run was resumed from an earlier checkpoint."""
    reader = SyntheticReader(TINY_LLAMA, Layout(tp=2), "float32", 0, optimizer=True)
    reader.common.extra["data_state"] = {"consumed_samples": 80, "seed": 1234, "num_samples": 1000}
    reader.common.args["seq_length"] = 64
    path = tmp_path / "ckpts" / "run1"
    stream(reader, make_plan(reader, path, Target(format="torch_dist", layout=Layout(tp=2), optimizer=True)))
    metrics = tmp_path / "run1.jsonl"
    records = [{"iteration": i, "loss": 9.0 - i / 10, "consumed_samples": 8 * i} for i in range(1, 11)]
    records.insert(9, {"iteration": 10, "loss": 1.0, "consumed_samples": 80})  # the killed run's, logged again below
    records.append({"event": "checkpoint_save", "iteration": 10})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, metrics


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _same_as_folder(hub: Hub, repo_id: str, folder, branch: str = "main") -> None:
    """Every file of `folder` (hidden ones excepted) is in the repo with the same sha256."""
    files = hub.repos[repo_id]["branches"][branch]
    local = {p.relative_to(folder).as_posix(): _sha(p.read_bytes()) for p in folder.rglob("*")
             if p.is_file() and not p.name.startswith(".")}
    assert local and {name: _sha(files[name]) for name in local if name in files} == local


def test_upload_verifies_writes_card_and_commits(export, monkeypatch):
    with Hub() as hub:
        monkeypatch.setenv("HF_TOKEN", hub.token)
        result = CliRunner().invoke(main, ["upload", str(export), "user/tiny", "--private", "--revision", "v1", "--endpoint", hub.url],
                                    standalone_mode=False)
        assert result.exception is None, result.exception
        repo = hub.repos["user/tiny"]
        assert repo["private"]
        files = repo["branches"]["v1"]
        assert {"config.json", "model.safetensors", "reshard_manifest.json", "README.md", "tokenizer_config.json"} <= set(files)
        assert files["model.safetensors"] == (export / "model.safetensors").read_bytes()
        assert hub.lfs_puts == [_sha(files["model.safetensors"])]  # the weights went through LFS
        card = files["README.md"].decode()
        assert "source layout" in card and "Qwen2ForCausalLM" in card and "checksums" in card.lower()
        assert _sha(files["model.safetensors"]) in card
        assert not (export / "README.md").exists()  # the card is never written to disk
        # exist_ok: a second upload to the same repo works; another repo gets a card of its own
        upload(export, "user/tiny", endpoint=hub.url, token=hub.token)
        assert "model.safetensors" in hub.repos["user/tiny"]["branches"]["main"]
        upload(export, "user/other", endpoint=hub.url, token=hub.token)
        assert "# other\n" in hub.repos["user/other"]["branches"]["main"]["README.md"].decode()


def test_upload_refuses_a_corrupted_export(export):
    data = bytearray((export / "model.safetensors").read_bytes())
    data[-3] ^= 0x40  # one flipped bit in the last tensor
    (export / "model.safetensors").write_bytes(bytes(data))
    with Hub() as hub:
        with pytest.raises(ReshardError, match="refusing to upload"):
            upload(export, "user/bad", endpoint=hub.url, token=hub.token)
        assert not hub.repos


def test_upload_reports_bad_token(export):
    with Hub() as hub:
        with pytest.raises(ReshardError, match="rejected the token from --token") as caught:
            upload(export, "user/x", endpoint=hub.url, token="wrong_token")
        assert "wrong_token" not in str(caught.value) and not hub.repos
        hub.tokens["hf_reader"] = "user"
        hub.read_only.add("hf_reader")
        with pytest.raises(ReshardError, match="token from --token is read-only"):
            upload(export, "user/x", endpoint=hub.url, token="hf_reader")
        assert not hub.repos


def test_upload_needs_a_reshard_export(tmp_path):
    source = build("gpt2", tmp_path / "src")
    with pytest.raises(ReshardError, match="reshard_manifest"):
        upload(source, "user/x", endpoint="http://127.0.0.1:9", token="t")


@pytest.mark.parametrize("repo_id,endpoint,message", [
    ("not a repo/../x", "http://127.0.0.1:9", "is not a Hub repository id"),
    ("user/x", "http://127.0.0.1:9", "cannot reach the Hub at http://127.0.0.1:9"),
])
def test_upload_refuses_what_cannot_work_in_one_line(export, repo_id, endpoint, message):
    with pytest.raises(ReshardError, match=message):
        upload(export, repo_id, endpoint=endpoint, token="t")
    assert not (export / "README.md").exists()


def test_a_megatron_checkpoint_is_exported_beside_it_uploaded_in_commits_and_carded(trained):
    ckpt, metrics = trained
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    lines = []
    with Hub() as hub:
        result = upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token, metrics=metrics, max_shard_bytes=SHARD,
                        commit_bytes=1, report=lines.append)
        staging = ckpt.with_name("run1-hf")
        assert result.folder == staging and result.exported and (staging / RECORD).is_file()
        _same_as_folder(hub, "user/run1", staging)
        files = hub.repos["user/run1"]["branches"]["main"]
        assert RECORD not in files
        shards = sorted(n for n in files if n.endswith(".safetensors"))
        assert len(shards) == 4
        # one commit per shard, largest first; the files that make it a model come last, together
        assert [paths for _, paths in hub.commits[:4]] == [[n] for n in sorted(shards, key=lambda n: -len(files[n]))]
        assert hub.commits[-1][1] == sorted(["config.json", "model.safetensors.index.json", "reshard_manifest.json", "README.md"])
        card = files["README.md"].decode()
        for fact in ["| iteration | 10 |", "| source format | torch_dist |", "| source layout | TP2PP1EP1 |",
                     "| tokens seen | 5,120 (80 samples of 64 tokens) |", "| final training loss | 8 (iteration 10, from `run1.jsonl`) |",
                     "| converted with | reshard", "| uploaded with | reshard", str(ckpt)]:
            assert fact in card, fact
        assert any(line.startswith("commit 4/6: 1 files") for line in lines), lines
        # the same command again: the export is reused (once its checksums verify) and nothing is uploaded
        commits, puts = len(hub.commits), len(hub.lfs_puts)
        again = upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token, metrics=metrics, max_shard_bytes=SHARD,
                       commit_bytes=1, report=lines.append)
        assert not again.exported and not again.committed and again.commit is None
        assert (len(hub.commits), len(hub.lfs_puts)) == (commits, puts)
        assert any(line.startswith("reusing the export") for line in lines)
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before  # the source is never modified


def test_a_changed_checkpoint_is_exported_again_and_a_foreign_staging_directory_is_refused(trained, tmp_path):
    ckpt, _ = trained
    with Hub() as hub:
        upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token)
        staging = ckpt.with_name("run1-hf")
        os.utime(ckpt / "latest_checkpointed_iteration.txt", ns=(1, 1))  # as if a new save had happened
        result = upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token)
        assert result.exported and result.folder == staging
        assert set(result.committed) <= {"reshard_manifest.json", "README.md"}  # the same weights (a new conversion time)
        foreign = tmp_path / "elsewhere"
        foreign.mkdir()
        (foreign / "notes.txt").write_text("mine\n")
        with pytest.raises(ReshardError, match="is not an export of"):
            upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token, staging=foreign)
        assert (foreign / "notes.txt").read_text() == "mine\n"
        other = shutil.copytree(ckpt, ckpt.with_name("run2"))  # another checkpoint's upload may not replace this export
        with pytest.raises(ReshardError, match="is not an export of"):
            upload(other, "user/run2", endpoint=hub.url, token=hub.token, staging=staging)
        assert json.loads((staging / RECORD).read_text())["source"] == str(ckpt.resolve())


def test_metrics_of_another_run_are_refused(trained, tmp_path):
    ckpt, _ = trained
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"iteration": 10, "loss": 2.0, "consumed_samples": 160}) + "\n")
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"iteration": 5, "loss": 2.0}) + "\n")
    with Hub() as hub:
        with pytest.raises(ReshardError, match="another run's log"):
            upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token, metrics=other)
        with pytest.raises(ReshardError, match="has no loss for iteration 10"):
            upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token, metrics=short)
        assert not hub.repos and not ckpt.with_name("run1-hf").exists()


def _reshard(*args, **popen):
    env = dict(os.environ, PYTHONPATH=pythonpath())
    return subprocess.Popen([sys.executable, "-m", "reshard", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize("commit_size", ["1", "5GiB"], ids=["commit-per-file", "one-commit"])
def test_an_upload_killed_midway_resumes_with_only_the_missing_files(trained, commit_size, monkeypatch):
    """The process is killed (SIGKILL) once the server has stored the second weight file; the same command
    run again sends only the files whose bytes the server never got: neither those committed, nor those stored
    by a commit that never happened."""
    ckpt, metrics = trained
    with Hub() as hub:
        monkeypatch.setenv("HF_TOKEN", hub.token)
        command = ["upload", ckpt, "user/run1", "--endpoint", hub.url, "--max-shard-size", SHARD, "--commit-size", commit_size,
                   "--metrics", metrics]
        first = _reshard(*command)
        hub.on_lfs_stored = lambda oid: first.kill() if len(hub.lfs_puts) == 2 else None
        first.communicate(timeout=120)
        assert first.returncode == -9
        hub.on_lfs_stored = None
        sent_before, committed_before = list(hub.lfs_puts), [p for _, paths in hub.commits for p in paths]
        commits_before = len(hub.commits)
        assert len(sent_before) >= 2 and "config.json" not in committed_before

        second = _reshard(*command)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        staging = ckpt.with_name("run1-hf")
        assert "reusing the export" in err and "commit" in err  # the export was not made again; progress is shown
        sent_after = hub.lfs_puts[len(sent_before):]
        files = hub.repos["user/run1"]["branches"]["main"]
        weights = {_sha(files[n]) for n in files if n.endswith(".safetensors")}
        assert len(weights) == 4
        assert not set(sent_after) & set(sent_before) and set(sent_after) | set(sent_before) == weights
        committed_after = [p for _, paths in hub.commits[commits_before:] for p in paths]
        assert not set(committed_after) & set(committed_before)  # a committed file is not committed again
        _same_as_folder(hub, "user/run1", staging)
        assert f"uploaded {ckpt} to {hub.url}/user/run1" in out


def test_cli_errors_are_one_line_and_never_show_the_token(trained, monkeypatch):
    ckpt, _ = trained
    with Hub() as hub:
        monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
        proc = _reshard("upload", ckpt, "user/run1", "--endpoint", hub.url)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and out == ""
        assert err.count("\n") == 1 and err.startswith("reshard: error: ") and "HF_TOKEN" in err, err
        assert "hf_secret_value_123" not in err
        assert not ckpt.with_name("run1-hf").exists()  # refused before any export
        monkeypatch.delenv("HF_TOKEN")
        proc = _reshard("upload", ckpt, "user/run1", "--endpoint", hub.url)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and err.startswith("reshard: error: no Hub token") and err.count("\n") == 1, err
        assert "secret" not in repr(Access("hf_secret_value_123", hub.url))


def test_the_export_follows_the_dtype_asked_for(trained):
    ckpt, _ = trained
    with Hub() as hub:
        first = upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token, dtype="bf16")
        again = upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token, dtype="bfloat16")  # the same, spelt out
        assert first.exported and not again.exported and not again.committed
        assert json.loads(hub.repos["user/run1"]["branches"]["main"]["config.json"])["dtype"] == "bfloat16"
        full = upload(ckpt, "user/run1", endpoint=hub.url, token=hub.token)  # the checkpoint's own float32
        assert full.exported and "model.safetensors" in full.committed
        assert json.loads(hub.repos["user/run1"]["branches"]["main"]["config.json"])["dtype"] == "float32"


# ----------------------------------------------------------- what an export may hold to be published (issue 22)

def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _weights_outside(folder):
    outside = folder.parent / "elsewhere"
    outside.mkdir()
    shutil.move(folder / "model.safetensors", outside / "model.safetensors")
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")


def _older_manifest(folder):
    manifest = json.loads((folder / "reshard_manifest.json").read_text())
    del manifest["provenance"]["hf_files"]
    (folder / "reshard_manifest.json").write_text(json.dumps(manifest))


TAMPERED = [
    (lambda f: _edit_json(f / "config.json", rms_norm_eps=1e-3), "config.json changed after the export"),
    (lambda f: (f / "config.json").write_text((f / "config.json").read_text() + " "), "config.json changed after the export"),
    (lambda f: _edit_json(f / "generation_config.json", eos_token_id=7), "generation_config.json changed after the export"),
    (lambda f: _edit_json(f / "tokenizer_config.json", model_max_length=7), "tokenizer_config.json changed after the export"),
    (lambda f: (f / "tokenizer.json").write_text("{}"), "tokenizer.json was added after the export"),
    (lambda f: (f / "chat_template.jinja").write_text("{{ x }}"), "chat_template.jinja was added after the export"),
    (lambda f: (f / "generation_config.json").unlink(), "generation_config.json is missing"),
    (_older_manifest, "records no sha256 of config.json"),
    (lambda f: (f / "modeling_evil.py").write_text("import os\n"), r"holds code .*modeling_evil\.py.*--allow-code"),
    (lambda f: (f / "sub").mkdir() or (f / "sub" / "x.py").write_text(""), r"holds code .*sub/x\.py"),
    (_weights_outside, "leads outside"),
    (lambda f: (f / "notes.txt").symlink_to("/etc/hostname"), "leads outside"),
]


@pytest.mark.parametrize("tamper,message", TAMPERED, ids=lambda v: getattr(v, "__name__", str(v))[:30])
def test_an_export_changed_or_given_code_after_its_checksums_is_not_uploaded(export, tmp_path, tamper, message):
    tamper(export)
    before = tree_digest(tmp_path)
    with Hub() as hub:
        with pytest.raises(ReshardError, match=message):
            upload(export, "user/x", endpoint=hub.url, token=hub.token)
        assert not hub.repos
    assert tree_digest(tmp_path) == before


def test_a_sharded_export_with_weights_outside_or_an_edited_index_is_not_uploaded(tmp_path):
    source = build("qwen2", tmp_path / "src")
    convert(source, tmp_path / "export", Target(format="hf", max_shard_bytes=SHARD))
    export = tmp_path / "export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "other").mkdir()
    shutil.copy(export / shard, tmp_path / "other" / shard)
    with Hub() as hub:
        for name in list(index["weight_map"]):  # the index names a copy outside the folder
            if index["weight_map"][name] == shard:
                index["weight_map"][name] = f"../other/{shard}"
        (export / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ReshardError, match="a path outside the checkpoint; refusing it"):
            upload(export, "user/x", endpoint=hub.url, token=hub.token)
        assert not hub.repos


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json", "modeling.py"])
def test_code_is_uploaded_only_with_allow_code(tmp_path, monkeypatch, where):
    source = build("qwen2", tmp_path / "src")
    auto_map = {"AutoModelForCausalLM": "modeling.Evil"}
    if where == "modeling.py":
        (source / "modeling.py").write_text("raise SystemExit\n")
    else:
        _edit_json(source / where, auto_map=auto_map)
    convert(source, tmp_path / "export", Target(format="hf"))
    export = tmp_path / "export"
    if where == "modeling.py":
        shutil.copy(source / "modeling.py", export / "modeling.py")  # reshard never copies code: a user added it
    else:
        assert json.loads((export / where).read_text())["auto_map"] == auto_map
    with Hub() as hub:
        monkeypatch.setenv("HF_TOKEN", hub.token)
        args = ["upload", str(export), "user/x", "--endpoint", hub.url, "-q"]
        result = CliRunner().invoke(main, args, standalone_mode=False)
        assert isinstance(result.exception, ReshardError) and "--allow-code" in str(result.exception) and where in str(result.exception)
        assert not hub.repos
        result = CliRunner().invoke(main, [*args, "--allow-code"], standalone_mode=False)
        assert result.exception is None, result.exception
        _same_as_folder(hub, "user/x", export)


@pytest.mark.parametrize("add, listed", [
    (lambda f: (f / "notes.txt").write_text("not checked\n"), ["notes.txt"]),
    (lambda f: (f / "extra").mkdir() or (f / "extra" / "data.bin").write_bytes(b"\0" * 64), ["extra/data.bin"]),
    (lambda f: (f / "sub").mkdir() or shutil.copy(f / "config.json", f / "sub" / "config.json"), ["sub/config.json"]),
    (lambda f: [(f / f"n{i}.txt").write_text(str(i)) for i in range(5)], ["n0.txt", "n1.txt", "n2.txt", ", ...", "5 file(s)"]),
], ids=["notes", "extra-folder", "nested-config", "five"])
def test_files_no_checksum_covers_are_published_only_with_include_unverified(tmp_path, monkeypatch, add, listed):
    """A reshard export is published under "checksums verified": a file beside it that nothing checks is refused,
    listed, with the source untouched and nothing on the Hub, until --include-unverified says to publish it."""
    source = build("qwen2", tmp_path / "src", max_shard_size="100KB")
    convert(source, tmp_path / "export", Target(format="hf", max_shard_bytes=SHARD))
    export = tmp_path / "export"
    add(export)
    before = tree_digest(export)
    with Hub() as hub:
        monkeypatch.setenv("HF_TOKEN", hub.token)
        args = ["upload", str(export), "user/x", "--endpoint", hub.url, "-q"]
        result = CliRunner().invoke(main, args, standalone_mode=False)
        assert isinstance(result.exception, ReshardError) and "--include-unverified" in str(result.exception)
        for word in listed:
            assert word in str(result.exception)
        assert not hub.repos and tree_digest(export) == before
        result = CliRunner().invoke(main, [*args, "--include-unverified"], standalone_mode=False)
        assert result.exception is None, result.exception
        assert "unverified (--include-unverified)" in result.output
        _same_as_folder(hub, "user/x", export)


def test_a_safetensors_file_the_index_does_not_name_is_unverified(tmp_path):
    """The model is read from the files its index names: another one beside them is checked by nothing."""
    convert(build("qwen2", tmp_path / "src"), tmp_path / "export", Target(format="hf", max_shard_bytes=SHARD))
    export = tmp_path / "export"
    shard = sorted(set(json.loads((export / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]
    shutil.copy(export / shard, export / "spare.safetensors")
    with Hub() as hub:
        with pytest.raises(ReshardError, match=r"holds 1 file\(s\) no checksum covers \(spare.safetensors\)"):
            upload(export, "user/x", endpoint=hub.url, token=hub.token)
        assert not hub.repos
        upload(export, "user/x", endpoint=hub.url, token=hub.token, include_unverified=True)
        assert "spare.safetensors" in hub.repos["user/x"]["branches"]["main"]
