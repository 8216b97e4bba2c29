"""The four environment variables sparsp reads, and the only module that reads any.

Every other setting is a :class:`sparsp.SparspConfig` field or a keyword argument. These four
are for deployment and debugging, where an argument cannot reach (docs/configuration.md has
the same table):

==================  ====================================================================
``SPARSP_PROFILE``  machine profile for ``strategy="auto"`` and the chunk rules: a built-in
                    name (``sparsp simulate --help`` lists them) or a calibrated JSON;
                    unset: picked from the transport (``h200x2-nvlink`` or ``h200x2-host``)
``SPARSP_SHM_TAG``  the tag in shared-memory segment names, for jobs that share ``/dev/shm``
                    and a rendezvous port (default: derived from the process group)
``SPARSP_HOST_ID``  this process's host name as the transports see it; ranks with different
                    ids are treated as on different hosts (to emulate several hosts on one);
                    unset: the node ``torchrun`` names, else the machine's own identity
``SPARSP_TRITON``   ``0`` turns every sparsp Triton kernel off: the torch form of each runs
                    (for debugging a kernel; default on where Triton and CUDA are present)
==================  ====================================================================

Values are read when asked for, so a spawned worker sees what its parent set. A ``SPARSP_*``
variable that is set but not one of these draws one warning naming it, once per process
(settings removed in 0.2.0 are listed in CHANGELOG.md).

Beside them this module reads variables that belong to other tools, not to sparsp:
``TRITON_INTERPRET`` (``triton_interpret``), which decides whether Triton can run a kernel on
CPU tensors at all (sparsp only asks, so it can refuse with a message instead of a crash);
``NCCL_P2P_DISABLE`` (``nccl_p2p_disabled``); and ``torchrun``'s ``GROUP_RANK`` and
``LOCAL_WORLD_SIZE`` (``torchrun_node``), which name a process's node. No other module reads
or writes ``os.environ`` (``tests/test_env.py``; the benchmark drivers under ``sparsp.bench``
are the exception, as they set up the processes they measure).
"""

from __future__ import annotations

import os
import warnings

PROFILE = "SPARSP_PROFILE"
SHM_TAG = "SPARSP_SHM_TAG"
HOST_ID = "SPARSP_HOST_ID"
TRITON = "SPARSP_TRITON"

KNOWN = (PROFILE, SHM_TAG, HOST_ID, TRITON)
"""Every environment variable sparsp reads."""


def _get(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def profile() -> str | None:
    """``SPARSP_PROFILE``: a profile name or JSON path, or None when unset."""
    return _get(PROFILE)


def shm_tag() -> str | None:
    """``SPARSP_SHM_TAG``: the shared-memory tag, or None when unset."""
    return _get(SHM_TAG)


def host_id() -> str | None:
    """``SPARSP_HOST_ID``: this process's emulated host name, or None when unset."""
    return _get(HOST_ID)


def triton_enabled() -> bool:
    """False when ``SPARSP_TRITON=0``: every Triton kernel then gives way to its torch form."""
    return _get(TRITON) != "0"


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton runs its kernels on CPU tensors in its
    interpreter (it must be set before Triton is imported; Triton's variable, not sparsp's)."""
    return _get("TRITON_INTERPRET") == "1"


def nccl_p2p_disabled() -> bool:
    """True when ``NCCL_P2P_DISABLE`` is set to a true value: NCCL then stages every transfer
    through host memory even between GPUs with peer access (NCCL's variable, not sparsp's;
    ``transport.nccl.peer_fabric`` reports the fabric it leaves)."""
    return (_get("NCCL_P2P_DISABLE") or "0").lower() not in ("0", "false", "no")


def torchrun_node() -> tuple[int, int] | None:
    """What ``torchrun`` tells every process of its node: ``(GROUP_RANK, LOCAL_WORLD_SIZE)``,
    the node's rank among the job's nodes and the processes it runs; None where either is unset
    or not an int (outside ``torchrun``). torchrun's variables, not sparsp's: a rank's host is
    its node (``transport.topology.host_id``) unless ``SPARSP_HOST_ID`` says otherwise, and
    ``sparsp.make_mesh`` checks that a Ulysses group fits in one node."""
    node, local = _get("GROUP_RANK"), _get("LOCAL_WORLD_SIZE")
    if node is None or local is None:
        return None
    try:
        return int(node), int(local)
    except ValueError:
        return None


def unknown() -> list[str]:
    """``SPARSP_*`` names set in the environment that sparsp does not read."""
    return sorted(n for n in os.environ if n.startswith("SPARSP_") and n not in KNOWN)


_warned: set[str] = set()


def warn_unknown() -> None:
    """One warning per ``SPARSP_*`` variable that is set but not read (a removed setting, or a
    misspelt one), once per process."""
    for name in unknown():
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"{name} is set but sparsp no longer reads it (see CHANGELOG.md); "
                          f"the environment variables it reads are {', '.join(KNOWN)}",
                          RuntimeWarning, stacklevel=2)


__all__ = ["HOST_ID", "KNOWN", "PROFILE", "SHM_TAG", "TRITON", "host_id", "nccl_p2p_disabled", "profile",
           "shm_tag", "torchrun_node", "triton_enabled", "triton_interpret", "unknown", "warn_unknown"]
