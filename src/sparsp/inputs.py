"""Input files of the command line, checked before any work starts: one ``ValueError`` line
that names the option, the file and what is wrong with it.

Every verb that reads a file (``analyze --trace``, ``trace --embeds``, ``simulate --fabric`` /
``--fit-profile`` / ``--validate``, ``bench report``) checks it here first, so an empty, text,
random, truncated or wrong-kind file never reaches a parser whose own error (a ``KeyError``, a
codec error, torch's advice on ``weights_only``) would not say which file or what is wrong.
This module imports nothing heavy: the bench verbs call it before their process group starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_renamed", "add_schedule_arguments", "add_thresholds_argument", "check_readable", "describe_content",
           "read_json", "torch_archive"]

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


def read_format(path, fmt: str, version: int) -> dict:
    """A sparsp JSON file of format ``fmt`` and ``version`` (a density profile, a calibration):
    its parsed dict; every fault a one-line ``ValueError`` naming the file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise ValueError(f"{path}: not a {fmt} file")
    if doc.get("version") != version:
        raise ValueError(f"{path}: version {doc.get('version')!r}, this sparsp reads {version}")
    return doc


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


class _Renamed(argparse.Action):
    """A flag given its old spelling: one line naming the new one on stderr, exit status 2
    (argparse's own error would add its usage), whatever values follow it."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="*", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: error: {option_string} is now {self.new} (CHANGELOG.md)", file=sys.stderr)
        raise SystemExit(2)


def add_renamed(p: argparse.ArgumentParser, old: str, new: str) -> None:
    """``old``, a flag renamed ``new``: hidden from ``--help`` and refused with one line naming
    ``new``, so a script written for the old spelling learns the new one."""
    p.add_argument(old, action=_Renamed, new=new)


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


def add_schedule_arguments(p: argparse.ArgumentParser, *, costs: str) -> None:
    """``--steps``, ``--dense-steps`` and ``--replan-every``: a denoising run and its schedule
    (``SparspConfig.dense_steps`` and ``replan_every``), as ``analyze`` and ``simulate`` spell
    them; ``costs``: what the verb reports for the run."""
    p.add_argument("--steps", type=int, default=50,
                   help=f"denoising steps of the run whose {costs} is reported")
    p.add_argument("--dense-steps", type=int, default=0, metavar="N",
                   help="the run's first N steps run exact dense attention through the strategy's dense path "
                        "(SparspConfig.dense_steps)")
    p.add_argument("--replan-every", type=int, default=1, metavar="K",
                   help="from step N on, a step solves its plan where (step - N) %% K == 0 and otherwise reuses the "
                        "last one: no mask phase, the kept plan's bytes (SparspConfig.replan_every)")


def add_thresholds_argument(p: argparse.ArgumentParser) -> None:
    """``--thresholds FILE``: per-(layer, head) thresholds (``sparsp.thresholds``) for the
    masks a verb makes."""
    p.add_argument("--thresholds", type=Path, default=None, metavar="FILE",
                   help="a per-(layer, head) thresholds table (docs/configuration.md): each layer's masks at "
                        "its own cdf (and sim) thresholds, the layers it leaves out at --cdf; a table of another "
                        "model's layers or heads, or with values outside [0, 1], is refused")
