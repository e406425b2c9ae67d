"""`rlft <kind> --help` at once: the text lists every field of the kind's four argument groups, which
live in dataclasses built on transformers' TrainingArguments, so rendering it imports transformers and
torch (about 7 s on 2 CPU cores). The rendered text is kept in the user's cache
(`$XDG_CACHE_HOME/rlft/help`, else `~/.cache/rlft/help`), one file per kind, under a key made of all it
depends on: the versions of Python, rlft, transformers, peft and accelerate, the size and modification
time of every rlft source file, and the terminal's width. Any change gives a new key, so a stale text is
never printed; the first `--help` after one renders it (and each training command renders every kind's
while its classes are loaded anyway, 0.14 s). A cache that cannot be written is skipped silently.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

_PACKAGES = ("transformers", "peft", "accelerate")


def _versions() -> str:
    found = []
    for name in _PACKAGES:
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name}=-")
    return ";".join(found)


@functools.cache
def _installation() -> str:
    """What every kind's help depends on besides the kind and the terminal (read once per process)."""
    import rlft

    root = Path(rlft.__file__).parent
    digest = hashlib.blake2b(f"{sys.version};{rlft.__version__};{_versions()}".encode(), digest_size=16)
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".json")):
                stat = os.stat(os.path.join(folder, name))
                digest.update(f"{os.path.relpath(folder, root)}/{name}:{stat.st_size}:{stat.st_mtime_ns};"
                              .encode())
    return digest.hexdigest()


def cache_key(kind: str) -> str:
    """The hex key of `kind`'s help text as this installation and terminal would render it."""
    width = shutil.get_terminal_size().columns
    return hashlib.blake2b(f"{kind};{width};{_installation()}".encode(), digest_size=16).hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rlft" / "help"


def render(kind: str) -> str:
    """`rlft <kind> --help` as HfArgumentParser prints it (loads the kind's config classes)."""
    from rlft.cli.recipes import make_parser
    from rlft.kinds import KINDS

    parser = make_parser(kind, prog=f"rlft {kind}", description=KINDS[kind].help, allow_abbrev=False,
                         usage=f"rlft {kind} [--config run.yaml] [--field value ...]")
    parser.add_argument("--config",
                        help="YAML file of fields of any of the groups below (TRL's recipe format)")
    parser.add_argument("--verbose", action="store_true", help="show third-party progress bars and logs")
    return parser.format_help()


def _store(path: Path, text: str) -> None:
    """Write `path` whole (a reader never sees half a text) and drop the kind's older texts."""
    kind = path.name.rpartition("-")[0]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(f"{kind}-*.txt"):
            if old.name.rpartition("-")[0] == kind:
                old.unlink(missing_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        pass  # a read-only home: rendered again next time


def _path(kind: str) -> Path:
    return cache_dir() / f"{kind}-{cache_key(kind)}.txt"


def help_text(kind: str) -> str:
    """The help of `rlft <kind>`: from the cache when its key matches, else rendered and kept."""
    path = _path(kind)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = render(kind)
        _store(path, text)
        return text


def warm(kinds) -> None:
    """Render and keep every kind's help not yet cached (called where the classes are loaded already)."""
    for kind in kinds:
        path = _path(kind)
        if not path.exists():
            _store(path, render(kind))
