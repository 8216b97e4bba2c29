"""The ``sparsp`` command line run in-process, for tests (fast: no interpreter start-up)."""

from __future__ import annotations


def run_cli(capsys, argv) -> tuple[int, str, str]:
    """``sparsp ARGV`` through ``sparsp.cli.main``: (exit status, stdout, stderr)."""
    from sparsp.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
