"""Callbacks: the `Callback` base class and the ready-made ones."""

from deepepochs.callbacks.base import Callback, HookTable

__all__ = ["Callback", "HookTable"]
