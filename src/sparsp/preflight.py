"""What a command settles before its work, and how it writes what the work produced.

Before: the output paths (``check_out_dir``, ``check_out_file``: a file where a directory is
wanted, a directory where a file is, a parent that is a file or not writable) and the optional
packages the command needs (``require``: the message names the extra that installs them). Each
is one ``ValueError`` line, raised before minutes of work instead of after them.

After: ``staged`` writes the results whole or not at all, so a command that fails or is
interrupted (Ctrl-C) leaves no partial file behind.

This module imports nothing heavy: the command line and the recipes call it before torch or
Diffusers load.
"""

from __future__ import annotations

import importlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

__all__ = ["check_out_dir", "check_out_file", "require", "staged"]


def _creatable(path: Path, where: str) -> None:
    """``ValueError`` unless ``path`` exists or could be made: its nearest existing ancestor is
    a directory this process may write in."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{where}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{where}: cannot write in {probe} (permission denied)")


def check_out_dir(path, option: str = "--out") -> None:
    """``ValueError`` unless ``path`` is a directory to write in, or one that can be made."""
    path = Path(path)
    where = f"{option} {path}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where} is a file; give a directory")
    _creatable(path, where)


def check_out_file(path, option: str = "--out", what: str = "the file to write") -> None:
    """``ValueError`` unless ``path`` can be written as a file (its directory made if need be)."""
    path = Path(path)
    where = f"{option} {path}"
    if path.is_dir():
        raise ValueError(f"{where} is a directory; give {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{where}: cannot overwrite it (permission denied)")
    _creatable(path.parent, where)


def require(extra: str, *modules: str, purpose: str) -> None:
    """``ValueError`` naming the first of ``modules`` that does not import and the extra that
    installs it. Importing is the check (a module found but broken fails it too); the command
    imports these modules right after anyway."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing = getattr(e, "name", None) or name
            raise ValueError(f"{purpose} needs {missing}, which is not installed: "
                             f"pip install -e \".[{extra}]\"") from None


@contextmanager
def staged(directory):
    """Files written into ``directory`` whole or not at all::

        with staged(out) as temp:
            (temp / "a.json").write_text(...)
            fig.savefig(temp / "b.png")

    The block writes into a hidden temporary directory beside ``directory`` (on the same file
    system) under the files' own names; when it ends, every file moves into ``directory`` (made
    if need be), replacing one of the same name. If the block raises (Ctrl-C included), the
    temporary directory goes and nothing in ``directory`` is touched."""
    directory = Path(os.path.abspath(directory))
    temp = directory.parent / f".{directory.name}.partial-{os.getpid()}"
    temp.mkdir(parents=True, exist_ok=True)
    try:
        yield temp
        directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(temp.iterdir()):
            os.replace(path, directory / path.name)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
