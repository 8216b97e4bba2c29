"""Units: byte sizes written the way people write them (``4MiB``, ``64k``).

A ground-floor module (it imports nothing of sparsp), so that the transports and the command
line can parse sizes without importing ``config``.
"""

from __future__ import annotations

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``4MiB``, ``64k``, ``1g`` or a plain integer (binary units, case-insensitive);
    ``ValueError`` for anything else."""
    t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(t[:-1]) * _UNITS[t[-1]]) if t and t[-1] in _UNITS else int(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 4MiB, 64KiB, 1048576)") from None


__all__ = ["parse_size"]
