"""Models and helpers for the notebooks on DDP's mechanics: buffers (BatchNorm), unused parameters, uneven inputs.

The DDP code itself (the wrapping, find_unused_parameters, static_graph, Join) stays in the notebooks' cells;
this module holds what those cells would otherwise copy: the models, and a way to print gloo's errors without
the parts that change from run to run.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

import torch
from torch import nn

from ..engine.config import ConfigError

AUX_MODES = ("never", "always", "alternate")
# gloo prefixes its errors with the C++ source location (a build path) and names the peer's address and port.
_SOURCE_LOCATION = re.compile(r"\[[^\[\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_ADDRESS = re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\]?:\d+")


class BatchNormNet(nn.Module):
    """Flatten -> Linear(784, hidden) -> BatchNorm1d(hidden) -> ReLU -> Linear(hidden, 10)."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(28 * 28, hidden)
        self.bn = nn.BatchNorm1d(hidden)  # its running_mean/running_var are buffers: state that is not a parameter
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(self.flatten(x)))))


class BranchNet(nn.Module):
    """A trunk (MLP, `depth` hidden layers) plus an auxiliary head that forward uses as `aux` says.

    aux="never": the head's parameters never get a gradient (DDP's unused-parameter case); "always": every
    forward adds the head's output; "alternate": every second forward in training mode does (the set of used
    parameters changes from step to step, which static_graph=True cannot follow).
    """

    def __init__(self, aux: str = "never", depth: int = 1, hidden: int = 32):
        super().__init__()
        check_aux(aux)
        if not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"BranchNet(depth={depth!r}) is not accepted: an int >= 1 (hidden layers)")
        layers = [nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, 10))
        self.trunk = nn.Sequential(*layers)
        self.aux_head = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
        self.aux = aux
        self.forwards = 0  # training-mode forwards so far ("alternate" uses the head on odd-numbered ones)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)
        if self.training:
            self.forwards += 1
        if self.aux == "always" or (self.aux == "alternate" and self.training and self.forwards % 2 == 1):
            out = out + self.aux_head(x)
        return out


def check_aux(aux: str) -> None:
    """Refuse an unknown aux mode, naming the accepted ones."""
    if aux not in AUX_MODES:
        raise ConfigError(f"BranchNet(aux={aux!r}) is not accepted: one of {AUX_MODES} (when forward uses the "
                          "auxiliary head)")


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """build() with torch's generator seeded by `seed`; the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_batchnorm_model(seed: int, hidden: int = 16) -> BatchNormNet:
    """BatchNormNet initialized from `seed` (the caller's random state is left as it was)."""
    return _seeded(seed, lambda: BatchNormNet(hidden))


def build_branch_model(seed: int, aux: str = "never", depth: int = 1, hidden: int = 32) -> BranchNet:
    """BranchNet initialized from `seed` (the caller's random state is left as it was)."""
    return _seeded(seed, lambda: BranchNet(aux, depth, hidden))


def tidy_error(text: str) -> str:
    """An error's text without gloo's C++ source locations and with addresses as ADDRESS (they vary by build
    and run), so that it reads the same every time."""
    return _ADDRESS.sub("ADDRESS", _SOURCE_LOCATION.sub("", text)).strip()


def comm_failure(text: str) -> Optional[str]:
    """What a collective's error says happened to it: "timeout", "peer closed the connection", or None (neither).

    gloo words a lost peer two ways: "Connection closed by peer" when the peer's socket closed cleanly, and
    "Connection reset by peer" when it closed with data still unread (the kernel then resets the connection).
    """
    if re.search(r"Timed out|timed out|Timeout", text):
        return "timeout"
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return "peer closed the connection"
    return None
