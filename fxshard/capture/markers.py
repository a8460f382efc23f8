"""Boundary markers: forward hooks that wrap a planned module's inputs and outputs in
``fxshard::boundary`` nodes while a model is traced (the plan's constraints apply to those nodes,
by their tags ``"<module fqn>:in:<i>"`` / ``":out:<i>"``)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..ir import boundary


class Markers:
    """Hooks on the modules of ``hooked`` ({fqn: (#inputs, #outputs) to mark}) while inside
    ``with Markers(model, hooked):``.  ``marking(False)`` passes values through unmarked for a
    while (a marker changes no tensor metadata): reuse_layers' probing pass."""

    def __init__(self, module: nn.Module, hooked: dict[str, tuple[int, int]] | None):
        self.module = module
        self.hooked = dict(hooked or {})
        self.on = True
        self._handles: list = []

    def __enter__(self) -> Markers:
        modules = dict(self.module.named_modules())
        for fqn, (n_in, n_out) in self.hooked.items():
            mod = modules[fqn]
            pre, post = self._pre(fqn, n_in), self._post(fqn, n_out)
            if n_in:
                self._handles.append(mod.register_forward_pre_hook(pre))
            if n_out:
                self._handles.append(mod.register_forward_hook(post))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def marking(self, on: bool):
        """Mark (``on``) or not inside; the previous setting comes back after."""
        was, self.on = self.on, on
        try:
            yield
        finally:
            self.on = was

    def _pre(self, fqn: str, n_in: int):
        def pre(_m, args):
            if not self.on:
                return None
            return tuple(
                boundary(a, f"{fqn}:in:{i}") if i < n_in and isinstance(a, torch.Tensor) else a
                for i, a in enumerate(args)
            )

        pre.fxshard_boundary = ("in", n_in)  # what the hook marks, for reuse_layers' "alike" test
        return pre

    def _post(self, fqn: str, n_out: int):
        def post(_m, _args, out):
            if not self.on:
                return None
            if isinstance(out, torch.Tensor):
                return boundary(out, f"{fqn}:out:0")
            if isinstance(out, tuple):
                return tuple(
                    boundary(o, f"{fqn}:out:{i}")
                    if i < n_out and isinstance(o, torch.Tensor)
                    else o
                    for i, o in enumerate(out)
                )
            return out

        post.fxshard_boundary = ("out", n_out)
        return post
