"""sparsp: sparsity-aware sequence-parallel attention for video diffusion transformers.

Public API: ``SparspConfig``, ``sp_attention`` (functional, local shards (B, S_local, H, D)),
``make_mesh`` (a device mesh of ``cfg``, ``sp`` and ``ulysses``), and the building blocks in
``geometry``, ``placement``, ``masks``, ``demand``.
"""

from . import env
from .config import SparspConfig

__version__ = "0.2.0"

env.warn_unknown()  # a stale or misspelt SPARSP_* variable: one warning, at import


def __getattr__(name):
    # Imported lazily so `sparsp analyze` and `import sparsp.geometry` stay light.
    if name in ("sp_attention", "close_transports"):
        from . import strategies

        return getattr(strategies, name)
    if name == "new_run":
        return new_run
    if name == "make_mesh":
        from .mesh import make_mesh

        return make_mesh
    if name in ("parallelize", "unparallelize"):  # needs diffusers only when called
        from .integrations import diffusers

        return getattr(diffusers, name)
    raise AttributeError(f"module 'sparsp' has no attribute {name!r}")


def new_run(transformer=None) -> None:
    """Start a new denoising run (``SparspConfig``'s schedule counts steps from 0 again):
    of the parallelized ``transformer``, or of direct ``sp_attention`` calls (None)."""
    if transformer is None:
        from .strategies import new_run as start
    else:
        from .integrations.diffusers import new_run as start
    start(transformer)


__all__ = ["SparspConfig", "new_run", "sp_attention", "close_transports", "make_mesh", "parallelize", "unparallelize",
           "__version__"]
