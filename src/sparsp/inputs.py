"""Input files of the command line, checked before any work starts: one ``ValueError`` line
that names the option, the file and what is wrong with it.

Every verb that reads a file (``analyze --trace``, ``trace --embeds``, ``simulate --fabric`` /
``--calibrate`` / ``--validate``, ``bench report``) checks it here first, so an empty, text,
random, truncated or wrong-kind file never reaches a parser whose own error (a ``KeyError``, a
codec error, torch's advice on ``weights_only``) would not say which file or what is wrong.
This module imports nothing heavy: the bench verbs call it before their process group starts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["check_readable", "describe_content", "read_json", "torch_archive"]

_ZIP_MAGIC = b"PK\x03\x04"


def _label(option: str | None, path) -> str:
    return f"{option} {path}" if option else str(path)


def check_readable(path, option: str | None = None) -> bytes:
    """The first bytes of ``path``; ``ValueError`` if it is missing, a directory, unreadable or empty."""
    where = _label(option, path)
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{where}: no such file")
    if path.is_dir():
        raise ValueError(f"{where}: is a directory, not a file")
    try:
        with path.open("rb") as f:
            head = f.read(64)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
    if not head:
        raise ValueError(f"{where}: the file is empty")
    return head


def describe_content(head: bytes) -> str:
    """What the first bytes of a file look like, for a message: JSON, text, a torch file, binary."""
    if head.startswith(_ZIP_MAGIC):
        return "a zip archive (torch.save)"
    stripped = head.lstrip()
    try:
        text = stripped.decode("utf-8")
    except UnicodeDecodeError:
        return "binary data"
    if text[:1] in ("{", "["):
        return "JSON text"
    return "text" if text.isprintable() or "\n" in text else "binary data"


def read_json(path, option: str | None = None, what: str = "JSON file"):
    """The parsed JSON of ``path``; one-line ``ValueError`` naming the option and the file."""
    where = _label(option, path)
    head = check_readable(path, option)
    if head.startswith(_ZIP_MAGIC):
        raise ValueError(f"{where}: not a {what}: it is a zip archive (a torch file such as a sparsp trace?)")
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not a {what}: it is binary data, not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a {what}: invalid or truncated JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno})") from None


def torch_archive(path, option: str | None = None, what: str = "torch file") -> None:
    """``ValueError`` unless ``path`` starts like a ``torch.save`` file (a zip archive)."""
    head = check_readable(path, option)
    if not head.startswith(_ZIP_MAGIC):
        raise ValueError(f"{_label(option, path)}: not a {what}: it is {describe_content(head)}, "
                         f"not a torch.save archive")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The verbs' ``--help``: each default shown (but ``None``, which each help text explains),
    and a description's examples kept as written."""

    def _get_help_string(self, action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def add_density_profile_arguments(p: argparse.ArgumentParser, *, use: str, fitted: str) -> None:
    """``--density-profile FILE``, ``--step S`` and ``--calibration FILE``, as every verb that
    takes a real model's per-head densities spells them (``sparsp.workloads.density``,
    ``sparsp.workloads.calibration``). ``use``: what the verb does with the calibrated heads; ``fitted``:
    where a fit made without ``--calibration`` is written."""
    p.add_argument("--density-profile", type=Path, default=None, metavar="FILE",
                   help="a per-(step, layer, head) density profile (.csv as published, or sparsp's .json) "
                        f"whose layers and heads match --model: {use}")
    p.add_argument("--step", type=int, default=None,
                   help="with --density-profile: the profile's step (1-based; default: the mean over steps)")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="with --density-profile: fitted heads to reuse (sparsp calibrate's JSON, or an earlier "
                        f"run's; a whole model takes minutes to fit); default: fit them now and write {fitted}")
