"""The pipeline's cache context of a parallelized model, for counting its steps (``steps.py``).

Diffusers 0.42 pipelines call the transformer inside ``transformer.cache_context(name,
step_index=..., ...)``, which sets that ``CacheContext`` on the ``StateManager`` of every
stateful hook in the model's ``HookRegistry`` (``hooks/hooks.py``, ``_set_cache_context``) and
clears it after the call. ``ContextHook`` is one such hook: it changes nothing in the forward
and holds the context for the model's entry hook to read; a pipeline resets its stateful hooks
at its end (``maybe_free_model_hooks``), which ends the model's run. Imported by ``parallelize``
only, so ``sparsp.integrations`` loads without Diffusers.
"""

from __future__ import annotations

from diffusers.hooks.hooks import BaseState, HookRegistry, ModelHook, StateManager

NAME = "sparsp_steps"
"""The hook's name in the model's ``HookRegistry``."""


class _Nothing(BaseState):
    """The per-context state ``StateManager`` makes: the hook keeps none, only the context."""

    def reset(self, *args, **kwargs) -> None:
        pass


class _Context(StateManager):
    """A ``StateManager`` that remembers the context the pipeline sets (None outside one)."""

    def __init__(self) -> None:
        super().__init__(_Nothing)
        self.current = None

    def set_context(self, context) -> None:
        super().set_context(context)
        self.current = context


class ContextHook(ModelHook):
    """Holds the model's current cache context (``context``); ``on_reset`` runs when the
    pipeline resets the model's stateful hooks."""

    _is_stateful = True  # Diffusers hands the cache context to stateful hooks only

    def __init__(self, on_reset) -> None:
        super().__init__()
        self.state = _Context()
        self.on_reset = on_reset

    @property
    def context(self):
        """The ``CacheContext`` of the forward now running (None: the caller gave none)."""
        return self.state.current

    def reset_state(self, module):
        self.state.reset()
        self.state.current = None
        self.on_reset()
        return module


def add(transformer, on_reset) -> ContextHook:
    """Register a ``ContextHook`` on ``transformer``; returns it."""
    hook = ContextHook(on_reset)
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(hook, NAME)
    return hook


def remove(transformer) -> None:
    """Remove the hook ``add`` registered (nothing else of the model's registry)."""
    HookRegistry.check_if_exists_or_initialize(transformer).remove_hook(NAME, recurse=False)


__all__ = ["ContextHook", "NAME", "add", "remove"]
