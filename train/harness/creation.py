"""The step-0 train state of a new run, compiled on a thread of its own while the training step compiles.

Only the step's shapes are needed to compile the step, and only the state's creation needs to run before the first
step; compiled one after the other, the creation's compilation (about 3 s for BERT-base on a GPU) would sit in the
run's start-up. `StateCreation` starts it as soon as the state's shapes are known and runs it once the training
step has compiled (`train.harness.loop.Loop`), so it overlaps the step's compilation and, as compilation, is
counted in that window.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
from typing import Any, Callable

import jax

from train.harness.step import TrainState, threefry_kernel


class StateCreation:
    """``create(pretrained)`` jitted with ``shardings`` for its output and compiled by ``executor`` (a thread) from
    construction on, in this thread's context (the kernel backend it selected), with JAX's threefry kernel drawing the
    parameters (`train.harness.step.threefry_kernel`). ``abstract`` is the state's shapes, what the training step
    compiles against meanwhile."""

    def __init__(
        self,
        create: Callable[[Any], TrainState],
        pretrained: Any,
        abstract: TrainState,
        shardings: TrainState,
        executor: concurrent.futures.Executor,
    ):
        self.abstract = abstract
        self._pretrained = pretrained
        jitted = jax.jit(create, out_shardings=shardings)

        def compile_creation() -> Any:
            with threefry_kernel():
                return jitted.lower(pretrained).compile()

        self._compiled = executor.submit(contextvars.copy_context().run, compile_creation)

    def result(self) -> TrainState:
        """Waits for the compilation (raising what it raised) and draws the state."""
        return self._compiled.result()(self._pretrained)
