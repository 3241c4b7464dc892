"""Recorders for inside a rank that the checks of a hand-built gradient synchronization add (notebook 0's two
blanks, notebook 3b's buckets): the hooks the learner registers and which of them is running, divisions into new
tensors, and the state an object keeps between backward passes (works never emptied, class attributes shared by
every instance). Like _watch's, they only record; the verdicts are made in the parent (_sync_checks).
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ._watch import Phase, _WatchedWork, patched, storage_of


# Where a learner may register code that autograd, a forward or an optimizer step calls: (owner, method, kind).
_MODULE_HOOKS = (("register_forward_pre_hook", "forward_pre"), ("register_forward_hook", "forward"),
                 ("register_full_backward_hook", "module_backward"))
_GLOBAL_HOOKS = (("torch.nn.modules.module", "register_module_forward_pre_hook", "forward_pre"),
                 ("torch.nn.modules.module", "register_module_forward_hook", "forward"),
                 ("torch.optim.optimizer", "register_optimizer_step_pre_hook", "step_pre"),
                 ("torch.optim.optimizer", "register_optimizer_step_post_hook", "step_post"))


@contextlib.contextmanager
def watch_hooks(params: List[torch.Tensor], running: Optional[Dict[str, Any]] = None,
                student_fn: Any = None, foreign: List[torch.Tensor] = ()) -> Iterator[List[Dict[str, Any]]]:
    """While inside: every hook registered on a tensor (register_post_accumulate_grad_hook or register_hook):
    on which parameter ("on": its index, "data" for a tensor sharing a parameter's storage, else "other"),
    its kind ("post" or "tensor"), and the parameter its closure holds once the block ends ("closes_over");
    and every forward or optimizer-step hook (on a module or global: "on" is "module" or "global").

    running: if given, a tensor hook sets running["hook"] to its parameter's index while it runs, and a
    post-accumulate hook that returns a value leaves running["returned"] = (its type, (file, line) of its def);
    running["handles"] collects the global hooks' handles, for the caller to remove. student_fn: the learner's
    function or class, whose globals bound to a global registration (`from torch.optim.optimizer import ...`) are
    watched too. foreign: parameters of another model (another object's): a hook on one has "on": "foreign"."""
    records: List[Dict[str, Any]] = []
    real = {"post": torch.Tensor.register_post_accumulate_grad_hook, "tensor": torch.Tensor.register_hook}
    running = {} if running is None else running
    running.setdefault("handles", [])

    def wrap(kind: str) -> Callable:
        def register(self: torch.Tensor, hook: Callable) -> Any:
            on = _param_of(self, params, foreign)
            records.append({"kind": kind, "on": on, "hook": hook})
            return real[kind](self, _traced(hook, on, kind, running))
        return register

    def module_hook(name: str, kind: str) -> Callable:
        def register(self: torch.nn.Module, hook: Callable, *args: Any, **kwargs: Any) -> Any:
            records.append({"kind": kind, "on": "module", "hook": hook})
            return real[name](self, hook, *args, **kwargs)
        return register

    def global_hook(register_real: Callable, kind: str) -> Callable:
        def register(hook: Callable, *args: Any, **kwargs: Any) -> Any:
            records.append({"kind": kind, "on": "global", "hook": hook})
            handle = register_real(hook, *args, **kwargs)
            running["handles"].append(handle)
            return handle
        return register

    for name, kind in _MODULE_HOOKS:
        real[name] = getattr(torch.nn.Module, name)
        setattr(torch.nn.Module, name, module_hook(name, kind))
    torch.Tensor.register_post_accumulate_grad_hook = wrap("post")  # type: ignore[method-assign]
    torch.Tensor.register_hook = wrap("tensor")  # type: ignore[method-assign]
    with contextlib.ExitStack() as stack:
        for module, name, kind in _GLOBAL_HOOKS:
            owner = importlib.import_module(module)
            if hasattr(owner, name):
                stack.enter_context(patched(student_fn, owner, name,
                                            lambda register_real, kind=kind: global_hook(register_real, kind)))
        try:
            yield records
        finally:
            torch.Tensor.register_post_accumulate_grad_hook = real["post"]  # type: ignore[method-assign]
            torch.Tensor.register_hook = real["tensor"]  # type: ignore[method-assign]
            for name, _ in _MODULE_HOOKS:
                setattr(torch.nn.Module, name, real[name])
            for r in records:  # read once the learner's loop has ended: a late-bound closure holds its last value
                r["closes_over"] = _closed_param(r.pop("hook"), params)


def _param_of(t: Any, params: List[torch.Tensor], foreign: List[torch.Tensor]) -> Any:
    """Which parameter t is: its index, "data" (a tensor sharing a parameter's storage), "foreign" or "other"."""
    for i, p in enumerate(params):
        if t is p:
            return i
    if isinstance(t, torch.Tensor) and any(storage_of(t) == storage_of(p) for p in params):
        return "data"
    return "foreign" if any(t is p for p in foreign) else "other"


def _traced(hook: Callable, on: Any, kind: str, running: Dict[str, Any]) -> Callable:
    """hook, noting in running which parameter's hook runs, and a post-accumulate hook that returns a value."""

    def traced(*args: Any) -> Any:
        outer, running["hook"] = running.get("hook"), on
        try:
            value = hook(*args)
        finally:
            running["hook"] = outer
        if value is not None and kind == "post" and "returned" not in running:
            code = getattr(hook, "__code__", None) or getattr(getattr(hook, "__func__", None), "__code__", None)
            running["returned"] = (type(getattr(value, "_work", value)).__name__,
                                   getattr(hook, "__name__", type(hook).__name__),
                                   (code.co_filename, code.co_firstlineno) if code is not None else None)
        # a watched work stands for torch's Work: autograd gets that one back, and its error names it as it would
        return value._work if isinstance(value, _WatchedWork) else value

    return traced


def _closed_param(hook: Any, params: List[torch.Tensor]) -> Optional[int]:
    """The index of the parameter a hook's closure holds (a lambda made in a loop: `lambda _: f(p)`), or None."""
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for i, p in enumerate(params):
            if value is p:
                return i
    return None


def late_bound(hooks: List[Dict[str, Any]]) -> Optional[int]:
    """The parameter every hook's closure holds when the hooks sit on different parameters, all closing over
    the same one (the loop variable's last value): the late-binding closure. None otherwise."""
    hooks = [h for h in hooks if h["kind"] in ("post", "tensor")]
    held = {h["closes_over"] for h in hooks}
    if len(hooks) >= 2 and len(held) == 1 and None not in held and len({h["on"] for h in hooks}) > 1:
        return held.pop()
    return None


@contextlib.contextmanager
def watch_divisions(params: Callable[[], List[torch.Tensor]], phase: Phase) -> Iterator[List[Dict[str, Any]]]:
    """While inside: every out-of-place division (`g / w`, `g.div(w)`) of a tensor that shares a p.grad's storage
    (p.grad itself, or a name bound to it), during backward or finish(): which parameter, where, by what number.

    `g = g / w` makes a new tensor and leaves p.grad as it was: when every p.grad ends up holding the sum, such a
    division names the mistake ("divided, into a new tensor"). In-place divisions (`/=`, div_) are not recorded.
    """
    records: List[Dict[str, Any]] = []
    real = {name: getattr(torch.Tensor, name) for name in ("__truediv__", "div")}
    own = {name: name in vars(torch.Tensor) for name in real}

    def wrap(name: str) -> Callable:
        def divided(self: torch.Tensor, other: Any, *args: Any, **kwargs: Any) -> Any:
            if phase() in ("backward", "finish") and self.layout == torch.strided:  # sparse: no storage to match
                s = storage_of(self)
                index = next((i for i, p in enumerate(params()) if p.grad is not None and
                              p.grad.layout == torch.strided and storage_of(p.grad) == s), None)
                if index is not None:
                    records.append({"index": index, "phase": phase(),
                                    "by": float(other) if isinstance(other, (int, float)) else None})
            return real[name](self, other, *args, **kwargs)
        return divided

    for name in real:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield records
    finally:
        for name in real:
            if own[name]:
                setattr(torch.Tensor, name, real[name])
            else:
                delattr(torch.Tensor, name)


def held_handles(obj: Any) -> int:
    """How many works or futures an object keeps in its attributes, or a function in its closure (lists,
    tuples, dicts and sets of them, pairs such as (p, work) included): what finish() left behind."""
    def count(value: Any, depth: int = 0) -> int:
        if isinstance(value, (_WatchedWork, torch.futures.Future)):
            return 1
        if depth < 2 and isinstance(value, (list, tuple, set)):
            return sum(count(v, depth + 1) for v in value)
        if depth < 2 and isinstance(value, dict):
            return sum(count(v, depth + 1) for v in value.values())
        return 0

    owner = getattr(obj, "__self__", None)  # a bound method such as a class's finish: its object's attributes
    values = [*vars(obj).values()] if hasattr(obj, "__dict__") else []
    values += [*vars(owner).values()] if hasattr(owner, "__dict__") else []
    for cell in getattr(obj, "__closure__", None) or ():  # a function such as 3b's finish: what it closes over
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return sum(count(v) for v in values)


def shared_containers(owner: Any) -> Dict[str, int]:
    """The lists, dicts, sets and deques every object or call of the learner's shares, with their sizes now: a
    class's class attributes (and its bases'), or a function's mutable default arguments and the module globals
    its code names. State every instance (or call) shares, when one fills it."""
    sizes: Dict[str, int] = {}

    def note(name: str, value: Any) -> None:
        if isinstance(value, (list, dict, set)) or type(value).__name__ == "deque":
            sizes.setdefault(name, len(value))

    if isinstance(owner, type):
        for klass in owner.__mro__[:-1]:
            if not klass.__module__.startswith(("torch", "builtins")):
                for name, value in vars(klass).items():
                    note(f"the class attribute `{klass.__name__}.{name}`", value)
        return sizes
    code = getattr(owner, "__code__", None)
    for value, name in zip(reversed(getattr(owner, "__defaults__", None) or ()),
                           reversed(code.co_varnames[:code.co_argcount] if code is not None else ())):
        note(f"the default argument `{name}`", value)
    glob = getattr(owner, "__globals__", {})
    for name in _names(code):
        if name in glob:
            note(f"the global `{name}`", glob[name])
    return sizes


def _names(code: Any) -> List[str]:
    """The global names a code object and the functions defined in it use."""
    if code is None:
        return []
    names = list(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names += _names(const)
    return names


def changed_shared(out: Dict[str, Any]) -> Optional[str]:
    """The first shared container (see shared_containers) whose size changed while the learner's code ran, said
    as "`name` went from a to b items"; None if none did."""
    for result in out["iterations"]:
        for sizes in result.get("shared", ()):
            for name, size in (sizes.items() if isinstance(sizes, dict) else ()):
                if size != out["shared_before"].get(name):
                    return f"{name} went from {out['shared_before'].get(name)} to {size} items"
    return None
