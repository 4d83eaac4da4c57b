"""Exported artifacts as files: the sidecar JSON beside each (``model.onnx.json``,
``model.engine.json``) and reading one back; where an export may write (never onto a file it
reads, or one edgetl did not make or made for another purpose); and writing an artifact and
its sidecar as a pair that is complete or absent.

A sidecar records the SHA-256 of its artifact (``"sha256"``), so a reader can tell an
artifact from another export (or one replaced after its sidecar was written) and refuse it
instead of running it with the wrong labels. Sidecars written before the field existed lack
it and are read as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from edgetl.errors import ConfigError, DataError
from edgetl.runfolder import LOCK, MANIFEST, Manifest, check_output_folder

SIDECAR_FORMAT = "edgetl-export/1"
ARTIFACTS = ("onnx", "tensorrt-engine")


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar_path(artifact: str | Path) -> Path:
    """Where an artifact's sidecar lives: the artifact's path with ``.json`` appended."""
    return Path(str(artifact) + ".json")


def read_sidecar(artifact: str | Path, kind: str) -> dict:
    """The sidecar of ``artifact``, checked to be an edgetl sidecar of a ``kind`` artifact
    (``"onnx"`` or ``"tensorrt-engine"``) that describes this very file.

    Raises:
        DataError: the artifact or its sidecar is missing or damaged, the sidecar is of another
            format or artifact kind, or its ``sha256`` is not the artifact's (another export's).
    """
    artifact = Path(artifact)
    path = sidecar_path(artifact)
    if not artifact.is_file():
        raise DataError(f"{kind} file {artifact} does not exist")
    if not path.is_file():
        raise DataError(f"sidecar {path} is missing: it holds the labels and preprocessing of {artifact} "
                        f"(edgetl export writes both); export again")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise DataError(f"sidecar {path} is damaged ({str(exc).splitlines()[0]}); export again") from None
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"sidecar {path} is not an edgetl export sidecar ({SIDECAR_FORMAT}); found {found!r}")
    if meta.get("artifact") != kind:
        raise DataError(f"sidecar {path} describes a {meta.get('artifact')!r} artifact, not {kind!r}: "
                        f"{artifact} and its sidecar do not belong together")
    if "sha256" in meta and meta["sha256"] != file_sha256(artifact):
        raise DataError(f"{artifact} is not the file its sidecar {path} describes (SHA-256 differs): "
                        f"replaced after export, or the sidecar of another export; export again")
    return meta


def is_edgetl_export(artifact: Path) -> bool:
    """Whether ``artifact`` is a file edgetl export wrote: its sidecar, in our format, names it
    (and, where the sidecar records one, its SHA-256 is the file's)."""
    try:
        meta = json.loads(sidecar_path(artifact).read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return False
    if not (isinstance(meta, dict) and meta.get("format") == SIDECAR_FORMAT and meta.get("artifact") in ARTIFACTS):
        return False
    if "sha256" in meta:
        try:
            return meta["sha256"] == file_sha256(artifact)
        except OSError:
            return False
    return meta.get("file") == artifact.name


def is_edgetl_sidecar(path: Path, artifact: Path) -> bool:
    """Whether ``path`` is an edgetl sidecar written for ``artifact`` (which may be gone)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return False
    return (isinstance(meta, dict) and meta.get("format") == SIDECAR_FORMAT
            and meta.get("artifact") in ARTIFACTS and meta.get("file") == artifact.name)


def refuse_json_name(path: Path) -> None:
    """An artifact named ``*.json`` would be taken for a sidecar (deploy refuses it as one)."""
    if path.suffix.lower() == ".json":
        raise ConfigError(f"output {path} ends in .json, the sidecars' suffix: a model file of that name would "
                          f"be taken for a sidecar; choose a .onnx or .engine name")



def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing
        return a.resolve() == b.resolve()


def _edgetl_names(folder: Path) -> set[str]:
    """The names edgetl recorded as its own in ``folder`` (none where its record is damaged:
    the file is then refused as the user's, which is refused all the same)."""
    try:
        manifest = Manifest(folder)
    except ConfigError:
        return set()
    return manifest.names | {MANIFEST, LOCK}


def check_outputs(artifacts: list[Path], reads: dict[Path, str]) -> None:
    """Before any work: each artifact path and its sidecar may be written.

    Refused in one line: a ``.json`` artifact name, a folder that cannot be made or written
    (``edgetl.runfolder.check_output_folder``), a path that is a folder or a symbolic link, a
    file the command reads (``reads``: path -> what it is), and an existing file that is not
    an earlier edgetl export of the same name (one edgetl made for another purpose, e.g. a
    run's checkpoint, or one it did not make at all). An earlier export is replaced whole.

    Raises:
        ConfigError: as above.
        ResourceError: a folder this user cannot write.
    """
    for artifact in artifacts:
        for path in (artifact, sidecar_path(artifact)):
            check_output_folder(path.parent, "export folder")
            shown = path if path == artifact else f"{path} (the sidecar of {artifact.name})"
            for source, what in reads.items():
                if _same_file(path, source):
                    raise ConfigError(f"output {shown} is {what}, which this export reads; choose another output path")
            if path.is_symlink():
                raise ConfigError(f"output {shown} is a symbolic link to {os.readlink(path)}: edgetl replaces "
                                  f"files, not links; give the path of a new file")
            if path.is_dir():
                raise ConfigError(f"output {shown} is a folder; give a file path")
            if not path.exists():
                continue
            ours = is_edgetl_export(path) if path == artifact else is_edgetl_sidecar(path, artifact)
            if ours:
                continue
            if path.name in _edgetl_names(path.parent):
                raise ConfigError(f"output {shown} is a file edgetl made for another purpose (listed in "
                                  f"{path.parent / MANIFEST}); choose another output path")
            raise ConfigError(f"output {shown} exists and is not an edgetl export: edgetl never overwrites files it "
                              f"did not create; choose another path or move it")
        refuse_json_name(artifact)
