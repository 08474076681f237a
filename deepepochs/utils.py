"""Small helpers: `set_seed`, the random number generators' states for checkpoints, and `every_step`
(releasing several things whatever one of them raises)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from deepepochs.errors import ConfigError

__all__ = ["every_step", "host_state", "rng_state", "set_rng_state", "set_seed"]


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and PyTorch (all devices); `deterministic` also asks cuDNN for determinism.

    `seed` is an int; a float with an integral value (0.6's examples call `set_seed(1.0)`) counts as that int,
    and so does a string of digits (`set_seed('3')`, which 0.6.18 accepted).
    """
    if isinstance(seed, float) and seed.is_integer():
        seed = int(seed)
    elif isinstance(seed, str) and seed.strip().lstrip("-").isdigit():
        seed = int(seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, or an integral float or string of digits (got {seed!r})")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def host_state() -> tuple:
    """The states of Python's and NumPy's global generators as they give them (`random.setstate`,
    `np.random.set_state` put them back)."""
    return random.getstate(), np.random.get_state()


def rng_state() -> dict:
    """The states of Python's, NumPy's and PyTorch's global generators (CPU and every initialised CUDA
    device) as tensors, numbers, strings, lists and dicts only, so `torch.load(weights_only=True)` reads
    them back."""
    (version, keys, gauss), (name, np_keys, pos, has_gauss, cached) = host_state()
    state = {
        "python": [version, list(keys), gauss],
        "numpy": {"bit_generator": name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned. CUDA states are restored for as many devices as both the file
    and this machine have."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["bit_generator"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        for index, device_state in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)


def every_step(steps, errors: list) -> None:
    """Call each of `steps` whatever the ones before raised: an `Exception` is appended to `errors`; a
    `KeyboardInterrupt` (any other `BaseException`) is raised once every step ran, so that a Ctrl-C in the
    middle of releasing things (a trainer's `close`) still releases the rest."""
    interrupt = None
    for step in steps:
        try:
            step()
        except Exception as e:
            errors.append(e)
        except BaseException as e:
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
