"""Seeds and RNG states: a seed in, every generator (torch, CUDA, numpy, random) seeded; states saved and restored."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and random; call before building the model."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every generator's state as tensors and numbers (loadable with weights_only=True)."""
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "python_version": int(version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": gauss,
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state((
        "MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
        state["numpy_has_gauss"], state["numpy_gauss"],
    ))
    random.setstate((state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]))
