"""A Hub repository as a conversion's source, against the Hub-compatible server in tests/converters: what
names a repository, which files are downloaded (never pickles or code), and one-line errors."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from reshard.cli import run
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.hub import Access, HubRepo, parse_source, weight_files
from reshard.verify import verify
from tests.converters.hf_models import build
from tests.converters.hub_server import Hub, isolate

NEEDED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"]


@pytest.fixture(autouse=True)
def hf_home(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path / "hf-home")


def _folder(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def hub(tmp_path):
    """org/qwen: a tiny Qwen2 model (main) and another one (branch v1), beside files a conversion must never
    fetch: pickled weights, code, a second safetensors file that is not the model's, a subfolder."""
    main = build("qwen2", tmp_path / "local-main")
    other = build("qwen2", tmp_path / "local-v1", seed=1)
    junk = {
        "pytorch_model.bin": pickle.dumps({"not": "loaded"}),
        "modeling_qwen2.py": b"import os\nos.system('echo pwned')\n",
        "consolidated.safetensors": b"\0" * 64,
        "sub/model.safetensors": b"\0" * 64,
        "README.md": b"# qwen\n",
    }
    with Hub() as server:
        server.add_repo("org/qwen", _folder(main) | junk)
        server.add_repo("org/qwen", _folder(other), branch="v1")
        yield server


def _reshard(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """The CLI's entry point in this process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["reshard", *map(str, args)])
    try:
        run()
        status = 0
    except SystemExit as exit:
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def _one_line_error(status, err, *words):
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 1 and len(lines) == 1 and lines[0].startswith("reshard: error: "), err
    for word in words:
        assert word in lines[0], lines[0]


def test_what_names_a_hub_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_source("hf://org/model") == HubRepo("org/model")
    assert parse_source("hf://org/model@refs/pr/1") == HubRepo("org/model", "refs/pr/1")
    assert parse_source("org/model@v1.0") == HubRepo("org/model", "v1.0")
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert parse_source("org/model") == Path("org/model")  # a local path that exists wins
    assert parse_source("hf://org/model") == HubRepo("org/model")  # unless hf:// says otherwise
    for local in ["./org/other", "/abs/path", "ckpts/run1/iter_0000010", "run1", "org/model@"]:
        assert isinstance(parse_source(local), Path), local
    for bad in ["hf://model", "hf://org/model@", "hf://org/../model", "hf://org/m@../x", "hf://a/b/c"]:
        with pytest.raises(ReshardError, match="does not name a Hub repository"):
            parse_source(bad)


def test_only_the_files_a_conversion_reads_are_chosen():
    repo = HubRepo("org/m")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    listing = {"model.safetensors.index.json": 1, "model-1.safetensors": 1, "model-2.safetensors": 1, "consolidated.safetensors": 1}
    assert weight_files(repo, listing, lambda: json.dumps(index).encode()) == [
        "model.safetensors.index.json", "model-1.safetensors", "model-2.safetensors"]
    assert weight_files(repo, {"model.safetensors": 1, "other.safetensors": 1}, None) == ["model.safetensors"]
    for shard in ["../evil.safetensors", "sub/x.safetensors", ".hidden.safetensors", "model.bin", "x*.safetensors"]:
        bad = {"weight_map": {"a": shard}}
        with pytest.raises(ReshardError, match="refusing it"):
            weight_files(repo, listing | {shard: 1}, lambda bad=bad: json.dumps(bad).encode())
    with pytest.raises(ReshardError, match="which the repository does not have"):
        weight_files(repo, {"model.safetensors.index.json": 1}, lambda: json.dumps(index).encode())
    with pytest.raises(ReshardError, match="not a safetensors index"):
        weight_files(repo, {"model.safetensors.index.json": 1}, lambda: b"[1, 2]")
    with pytest.raises(ReshardError, match="only as PyTorch pickles"):
        weight_files(repo, {"pytorch_model.bin": 1, "config.json": 1}, None)


def test_a_token_is_never_shown():
    access = Access("hf_abcdefghijklmnop", "http://127.0.0.1:9")
    assert "hf_abcdefghijklmnop" not in repr(access) and "--token" in repr(access)
    assert access.redact("Bearer hf_abcdefghijklmnop\n") == "Bearer <token>\n"
    with pytest.raises(ReshardError) as caught:
        Access("hf_abc def\n")
    assert "hf_abc" not in str(caught.value)


def _without_provenance(out: Path) -> dict[str, bytes]:
    """Everything a conversion wrote but what names its source (the manifest's provenance, common.pt's args)."""
    return {k: v for k, v in _folder(out).items() if not k.endswith(("reshard_manifest.json", "common.pt"))}


def test_a_conversion_from_a_repo_id_equals_one_from_the_local_folder(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["--to-format", "torch_dist", "--to-tp", "2", "--endpoint", hub.url]
    status, _, err = _reshard(monkeypatch, capsys, "convert", "org/qwen", "from-hub", *args)
    assert status == 0, err
    assert "downloading hf://org/qwen" in err
    assert sorted(hub.fetched("org/qwen")) == NEEDED  # no pickles, code, other weights or subfolders
    status, _, err = _reshard(monkeypatch, capsys, "convert", tmp_path / "local-main", "from-folder", *args)
    assert status == 0, err
    hubbed, local = tmp_path / "from-hub", tmp_path / "from-folder"
    assert _without_provenance(hubbed) == _without_provenance(local)
    with open_checkpoint(hubbed) as a, open_checkpoint(local) as b:
        assert a.manifest.checksums == b.manifest.checksums
        where = ("hf_source", "tokenizer_model")  # the folder read: the cache's snapshot, or the local one
        # by repr: the pickled enums in the args are stand-ins, which compare by identity
        assert {k: repr(v) for k, v in a.common.args.items() if k not in where} == {
            k: repr(v) for k, v in b.common.args.items() if k not in where
        }
    # again: everything comes from the cache
    status, _, err = _reshard(monkeypatch, capsys, "convert", "hf://org/qwen", "again", *args)
    assert status == 0, err
    assert sorted(hub.fetched("org/qwen")) == NEEDED
    assert _without_provenance(tmp_path / "again") == _without_provenance(local)


def test_a_revision_and_a_dropped_connection(hub, tmp_path, monkeypatch, capsys):
    """hf://org/model@branch converts that branch; a download cut off midway resumes where it stopped (at the
    last whole chunk the client read: 10 MiB on a real download, 64 KiB here)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)
    hub.cut_once.add("model.safetensors")
    status, _, err = _reshard(monkeypatch, capsys, "convert", "hf://org/qwen@v1", tmp_path / "v1", "--to-format", "hf",
                              "--endpoint", hub.url)
    assert status == 0, err
    assert hub.ranges and hub.ranges[0][0] == "model.safetensors" and hub.ranges[0][1] != "bytes=0-"
    assert verify(tmp_path / "v1", against=tmp_path / "local-v1").comparison.ok  # the branch's model, every value
    assert not verify(tmp_path / "v1", against=tmp_path / "local-main").comparison.ok


def test_what_cannot_be_downloaded_is_one_line_and_never_shows_the_token(hub, tmp_path, monkeypatch, capsys):
    main = _folder(tmp_path / "local-main")
    hub.add_repo("org/gated", main, gated={"someone-else"})
    hub.add_repo("org/pickles", {"config.json": main["config.json"], "pytorch_model.bin": b"\x80\x04N."})
    hub.add_repo("org/escape", {"config.json": main["config.json"], "model.safetensors.index.json":
                                json.dumps({"weight_map": {"w": "../../../../evil.safetensors"}}).encode()})
    monkeypatch.setenv("HF_TOKEN", hub.token)
    Access(hub.token, hub.url).api().create_repo("user/empty")  # exists, with no commit yet
    cases = [
        ("user/empty", ["user/empty has no commits yet", "no model in it"]),
        ("hf://user/empty", ["user/empty has no commits yet", "no model in it"]),
        ("org/gated", ["org/gated is gated", "HF_TOKEN"]),
        ("org/absent", ["there is no local path org/absent", "has no model org/absent"]),
        ("hf://org/qwen@nope", ["has no revision 'nope'"]),
        ("org/pickles", ["only as PyTorch pickles"]),
        ("org/escape", ["refusing it"]),
    ]
    for source, words in cases:
        status, out, err = _reshard(monkeypatch, capsys, "convert", source, tmp_path / "out", "--endpoint", hub.url)
        _one_line_error(status, err, *words)
        assert out == "" and not (tmp_path / "out").exists()
    assert hub.fetched("org/pickles") == ["config.json"]  # never the pickle
    assert hub.fetched("org/escape") == ["config.json", "model.safetensors.index.json"]
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_valid_token_42")
    status, _, err = _reshard(monkeypatch, capsys, "convert", "org/qwen", tmp_path / "out", "--endpoint", hub.url)
    _one_line_error(status, err, "rejected the token from HF_TOKEN")
    assert "hf_not_a_valid_token_42" not in err
    status, _, err = _reshard(monkeypatch, capsys, "convert", "org/qwen", tmp_path / "out", "--endpoint", hub.url,
                              "--token", "hf_given_on_the_command_line")
    _one_line_error(status, err, "rejected the token from --token")
    assert "hf_given_on_the_command_line" not in err
