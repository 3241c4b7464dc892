"""torch.compile with DDP, for the lesson: a model Dynamo can trace under DDP, a backend that counts the graphs
it is given, and whether this machine has the C++ compiler that Inductor's CPU code needs.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch import nn


class DeepMLP(nn.Module):
    """`depth` Linear(width, width) layers with a ReLU between each two.

    Its forward is written out here, not an nn.Sequential: DDP's forward breaks Dynamo's graph before it calls
    the wrapped module, and a frame that starts inside torch.nn is not compiled (trace_rules' MOD_SKIPLIST).
    """

    def __init__(self, width: int = 512, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def build_deep_mlp(seed: int, width: int = 512, depth: int = 6) -> DeepMLP:
    """DeepMLP initialized from `seed` (the caller's random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DeepMLP(width, depth)


class GraphCounter:
    """A torch.compile backend that runs each graph as traced (no code generation) and notes what it got.

    Under DDP, DDPOptimizer calls the backend once per piece of the split graph, so `layers` ends up with one
    entry per piece: how many Linear layers it holds, in forward order; `dynamic` says for each piece whether
    some input size is a symbol (a graph for every batch size) rather than a number (a graph for that size only).
    `then` (e.g. Inductor's compile_fx) compiles each piece after it is counted.
    """

    def __init__(self, then: Optional[Callable] = None):
        self.layers: List[int] = []
        self.dynamic: List[bool] = []
        self.then = then

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[Any]):
        self.layers.append(sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is
                               torch._C._nn.linear))
        self.dynamic.append(any(isinstance(size, torch.SymInt) for t in example_inputs
                                if isinstance(t, torch.Tensor) for size in t.shape))
        return self.then(gm, example_inputs) if self.then is not None else gm.forward


def cxx_compiler() -> Optional[str]:
    """The C++ compiler Inductor would use on CPU, or None where it finds none (e.g. Windows without MSVC)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # noqa: BLE001 - InvalidCxxCompiler, RuntimeError (Windows' checks), ImportError...
        return None
