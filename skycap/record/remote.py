"""Reading a record mirror: an fsspec URL listed and copied into a local cache directory.

Every reader (`skycap check`, `summary`, `validate`, `view`, `skycap.load`) reads a
directory by the rules of format.md §3. A mirror URL is turned into one: its top-level
`*.zst` files (and, for the viewer, the run index's `index/<phase>/step-<N>.json`) are
listed through fsspec and only new or changed files (by size and
ETag / modification time) are streamed into a cache directory, so a second run, or the
viewer's next rescan, fetches nothing that has not changed. Files that left the mirror
leave the cache. A sidecar the mirror never held (an excluded kind) is simply not in the
cache, which readers read as absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from skycap.record.layout import DOCUMENT_SUFFIX, document_name, is_plain_name
from skycap.record.mirror import open_store, redact
from skycap.record.reader import RecordError, read_document

STORAGE_OPTIONS_ENV = "SKYCAP_STORAGE_OPTIONS"
CACHE_ENV = "SKYCAP_CACHE_DIR"
INDEX_NAME = ".skycap-mirror-index.json"
INCOMING = ".incoming"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_INDEX_FILE = re.compile(r"^index/[A-Za-z0-9_.-]+/step-[0-9]+\.json$")


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether a reader's argument names a mirror (`s3://…`, `file://…`) rather than a path."""
    return isinstance(location, str) and bool(_URL.match(location))


def storage_options(text: str | None = None) -> dict[str, Any]:
    """`--storage-options JSON`, else `$SKYCAP_STORAGE_OPTIONS`, else `{}`; ValueError if bad."""
    source = "--storage-options"
    if text is None:
        text, source = os.environ.get(STORAGE_OPTIONS_ENV), STORAGE_OPTIONS_ENV
    if not text:
        return {}
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{source} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be a JSON object, got {text!r:.60}")
    return value


def default_cache_dir(url: str) -> Path:
    """`$SKYCAP_CACHE_DIR`, else `$XDG_CACHE_HOME/skycap` (or `~/.cache/skycap`), then
    `mirrors/<hash of the URL>`: one cache directory per mirror URL."""
    base = os.environ.get(CACHE_ENV)
    if base:
        root = Path(base)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skycap"
    digest = hashlib.sha256(redact(url).rstrip("/").encode()).hexdigest()[:16]
    return root.expanduser().absolute() / "mirrors" / digest


def _fingerprint(entry: Mapping[str, Any]) -> str:
    """What tells a changed remote file from the copy already cached."""
    parts = [entry.get("size")]
    for key in ("ETag", "etag", "md5Hash", "LastModified", "mtime", "updated", "created"):
        if key in entry:
            parts.append(entry[key])
    return orjson.dumps(parts, default=str).decode()


class MirrorCache:
    """A local copy of a mirror URL's records, refreshed on demand; `path` is a record dir."""

    def __init__(
        self,
        url: str,
        options: Mapping[str, Any] | None = None,
        *,
        cache_dir: Path | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.label = redact(self.url)
        self.fs, self.root = open_store(self.url, options)
        self.path = Path(cache_dir) if cache_dir is not None else default_cache_dir(self.url)
        self.path.mkdir(parents=True, exist_ok=True)
        self._index_path = self.path / INDEX_NAME
        self._index: dict[str, str] = self._read_index()

    def _read_index(self) -> dict[str, str]:
        try:
            value = orjson.loads(self._index_path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        return value if isinstance(value, dict) else {}

    def _save_index(self) -> None:
        temp = self.path / f".{INDEX_NAME}.tmp"
        temp.write_bytes(orjson.dumps(self._index))
        os.replace(temp, self._index_path)

    def listing(self) -> dict[str, str]:
        """Fingerprints of the visible `*.zst` files at the top level of the mirror."""
        self.fs.invalidate_cache(self.root)  # fsspec caches listings: see new records
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise RecordError(f"cannot list {self.label}: {type(exc).__name__}: {exc}") from None
        found = {}
        for entry in entries:
            name = str(entry.get("name", "")).rstrip("/").rpartition("/")[2]
            if entry.get("type") != "file" or not is_plain_name(name) or not name.endswith(".zst"):
                continue
            found[name] = _fingerprint(entry)
        return found

    def index_listing(self) -> dict[str, str]:
        """Fingerprints of the mirror's run index files, `index/<phase>/step-<N>.json`."""
        try:
            entries = self.fs.glob(f"{self.root}/index/*/step-*.json", detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise RecordError(f"cannot list {self.label}: {type(exc).__name__}: {exc}") from None
        found = {}
        root = self.root.strip("/") + "/"
        for path, entry in entries.items():
            name = str(path).lstrip("/").removeprefix(root)
            if _INDEX_FILE.match(name):
                found[name] = _fingerprint(entry)
        return found

    def refresh(self, *, sidecars: bool = True, index: bool = False) -> Path:
        """Bring the cache up to date (documents only unless `sidecars`; the run index's
        files too with `index`); return its path.

        Sidecars are fetched before documents, as the mirror copies them, so a document in
        the cache finds the sidecars the mirror held when it was listed.
        """
        remote = self.listing()
        if index:
            remote.update(self.index_listing())
        wanted = {
            name: stamp
            for name, stamp in remote.items()
            if sidecars or name.endswith(DOCUMENT_SUFFIX)
        }
        stale = [
            name
            for name, stamp in wanted.items()
            if self._index.get(name) != stamp or not (self.path / name).is_file()
        ]
        stale.sort(key=lambda name: name.endswith(DOCUMENT_SUFFIX))
        self._download(stale, wanted)
        for name in list(self._index):
            if name not in remote and (index or not name.startswith("index/")):
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()
                del self._index[name]
        self._save_index()
        return self.path

    def fetch_record(self, trajectory_id: str) -> Path:
        """Bring one record (its document and the sidecars it lists) into the cache."""
        name = document_name(trajectory_id)
        remote = self.listing()
        if name not in remote:
            raise RecordError(f"no record {trajectory_id} in {self.label}")
        self._download([name], remote)
        document = read_document(self.path / name)
        listed = [
            entry.get("file") for entry in document["sidecars"].values() if isinstance(entry, dict)
        ]
        sidecars = [file for file in listed if isinstance(file, str) and file in remote]
        self._download(sidecars, remote)
        self._save_index()
        return self.path

    def _download(self, names: list[str], stamps: Mapping[str, str]) -> None:
        """Stream `names` into a staging folder, then rename each onto its cached name."""
        if not names:
            return
        incoming = self.path / INCOMING
        incoming.mkdir(exist_ok=True)
        sources = [f"{self.root}/{name}" for name in names]
        targets = [str(incoming / name) for name in names]
        for target in targets:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get(sources, targets)
        except Exception as exc:
            raise RecordError(f"cannot read {self.label}: {type(exc).__name__}: {exc}") from None
        for name in names:
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(incoming / name, self.path / name)
            self._index[name] = stamps[name]
        shutil.rmtree(incoming, ignore_errors=True)


def local_dir(location: str | os.PathLike[str], options: Mapping[str, Any] | None = None) -> Path:
    """The directory a reader reads: `location` itself, or the refreshed cache of a URL."""
    if is_url(location):
        return MirrorCache(str(location), options).refresh()
    return Path(location)
