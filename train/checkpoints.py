"""Checkpoints of a training run with orbax: the train state (arrays) and its progress (JSON), per step.

A checkpoint holds two items: ``state``, the pytree of arrays (params, optimizer state, step, RNG key, loss
scale), and ``progress``, a JSON object with everything else a run needs to continue exactly (data position,
cumulative time/token/energy counters) and a ``model`` signature that a resume compares before restoring arrays.
The last ``keep`` checkpoints are kept. Saving is asynchronous; `Checkpoints.wait` blocks until the writes are
on disk (call it before exiting).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


class CheckpointMismatchError(ValueError):
    """The checkpoint was written for another model or vocabulary than the one being restored into."""


class Checkpoints:
    def __init__(self, directory: str | Path, *, keep: int = 3, saved_form: Callable[[Any], Any] | None = None):
        """``saved_form`` maps the train state to what is written (e.g. a sharded optimizer state gathered)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory).resolve()
        self._saved_form = saved_form or (lambda state: state)
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, progress: dict[str, Any]) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(self._saved_form(state)), progress=ocp.args.JsonSave(progress)),
            force=True,
        )

    def progress(self, step: int) -> dict[str, Any]:
        restored = self._manager.restore(step, args=ocp.args.Composite(progress=ocp.args.JsonRestore()))
        return restored["progress"]

    def restore(self, step: int, abstract_state: Any, model: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The state and progress saved at ``step``, restored onto ``abstract_state``'s shapes and shardings.

        Raises:
          CheckpointMismatchError: the checkpoint's ``model`` signature differs from ``model``.
        """
        progress = self.progress(step)
        saved = progress.get("model")
        if saved != model:
            differences = ", ".join(
                f"{key}: checkpoint {saved.get(key)!r} vs now {model.get(key)!r}"
                for key in sorted(set(saved or {}) | set(model))
                if (saved or {}).get(key) != model.get(key)
            )
            raise CheckpointMismatchError(f"checkpoint {self.directory}/{step} does not fit this model ({differences})")
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )
        return restored["state"], progress

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
