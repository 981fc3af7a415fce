"""Reading and writing the project's files: strict loaders and atomic writers.

Every output goes through `atomic_write_*` so that a failure never leaves a partial file
(docs/architecture.md, Conventions), and every input through `load_*` so that a missing or
malformed file is one HrmError naming the file.
"""

from __future__ import annotations

import codecs
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hrm.errors import HrmError


def load_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a missing or malformed file is an HrmError naming it."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise HrmError(
            f"{path}: malformed JSON ({exc.msg} at line {exc.lineno}); fix the file"
        ) from None


def load_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file; a missing or malformed file is an HrmError naming it."""
    text = read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise HrmError(f"{path}: malformed YAML{line}; fix the file") from None


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A text file's contents as UTF-8, a leading byte-order mark dropped (editors on Windows
    write one); a missing path, a directory or another encoding is an HrmError naming the file.
    what: the kind of file a message names ("prompts file")."""
    p = Path(path)
    if not p.exists():
        raise HrmError(f"{p}: no such {what}; check the path")
    if p.is_dir():
        raise HrmError(f"{p}: is a directory, not a {what}; give the file's path")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise HrmError(f"{p}: cannot read ({exc.strerror}); check the file") from None
    bom = next((name for mark, name in _BOMS if data.startswith(mark)), None)
    if bom is not None:
        raise HrmError(f"{p}: the {what} is {bom} text; save it as UTF-8")
    if b"\0" in data:  # valid UTF-8, but no text file holds one: UTF-16 without its mark
        line = data.count(b"\n", 0, data.index(b"\0")) + 1
        raise HrmError(f"{p}:{line}: the {what} holds NUL bytes (UTF-16 text?); save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise HrmError(
            f"{p}:{line}: the {what} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None


# byte-order marks of the encodings that are not UTF-8, longest first (UTF-32's begin as UTF-16's)
_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def check_writable(path: str | os.PathLike) -> Path:
    """Fail early, before any long work, if `path` cannot be written.

    Writability is tested by creating (and removing) a file beside it: permission bits say
    nothing to root, and read-only or virtual file systems refuse only when asked.
    """
    p = Path(path)
    parent = p.parent
    if p.is_dir():
        raise HrmError(f"{p}: is a directory; give a file name to write")
    if not parent.is_dir():
        raise HrmError(f"{p}: directory {parent} does not exist; create it or choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", dir=parent)
    except OSError as exc:
        raise HrmError(
            f"{p}: directory {parent} is not writable ({exc.strerror}); choose another path"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return p


def check_writable_dir(path: str | os.PathLike) -> Path:
    """Fail early if the output directory `path` cannot be made or written into."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise HrmError(f"{p}: exists and is not a directory; choose another output directory")
    check_writable((p if p.is_dir() else p.parent) / ".hrm-probe")
    return p


IMAGE_FORMATS = (".png", ".pdf", ".svg")


def check_image_path(path: str | os.PathLike, flag: str) -> Path:
    """A chart's path, checked before any work: writable, and named for a format we draw."""
    p = check_writable(path)
    if p.suffix.lower() not in IMAGE_FORMATS:
        raise HrmError(
            f"{flag} {p}: a chart is written as {', '.join(IMAGE_FORMATS)}; "
            f"name the file with one of these (e.g. {p.stem or 'chart'}.png)"
        )
    return p


def save_figure(fig, path: str | os.PathLike) -> Path:
    """A matplotlib figure written atomically, in the format its name says."""
    fmt = Path(path).suffix.lstrip(".").lower()
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt))


def new_file_mode() -> int:
    """The mode a new file gets under the user's umask (mkstemp's 0600 would survive the rename
    and hide outputs from teammates on a shared machine)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)`, then rename the temporary file onto `path`.

    The temporary file sits in the destination directory, so the rename is atomic and a crash
    or error inside `write` leaves no partial output behind. The file takes the user's umask.
    """
    p = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent)
    os.fchmod(fd, new_file_mode())
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        os.replace(tmp_path, p)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise HrmError(f"{p}: cannot write ({exc.strerror}); choose another path") from None
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return p


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_write_yaml(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, yaml.safe_dump(obj, sort_keys=False))
