"""Where a reading command's records come from: a directory, or a mirror URL via its cache."""

from __future__ import annotations

import argparse
from pathlib import Path

STORAGE_HELP = (
    "JSON object passed to fsspec for mirror URLs (endpoint_url, key, secret, profile, ...); "
    "default $SKYCAP_STORAGE_OPTIONS"
)


class SourceError(Exception):
    """A location that cannot be read; its str says which and why."""


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-options", metavar="JSON", default=None, help=STORAGE_HELP)


def record_dir(location: str, args: argparse.Namespace, *, sidecars: bool) -> Path:
    """The local directory holding `location`'s records: the directory itself, or the cache
    of a mirror URL brought up to date (documents only unless `sidecars`)."""
    from skycap.record.remote import is_url

    if not is_url(location):
        if not Path(location).is_dir():
            raise SourceError(f"{location} is not a directory")
        return Path(location)
    from skycap.record.reader import RecordError
    from skycap.record.remote import MirrorCache, storage_options

    try:
        cache = MirrorCache(location, storage_options(args.storage_options))
        return cache.refresh(sidecars=sidecars)
    except (ImportError, ValueError, TypeError, RecordError, OSError) as exc:
        raise SourceError(str(exc)) from None
