"""deepepochs 0.6's module `deepepochs.loops`: its names now come from the package root (`from deepepochs import
...`); importing one from here works with a DeprecationWarning that says so (`compat.moved`)."""

from deepepochs.compat import moved

__all__: list[str] = []

__getattr__ = moved(__name__)
