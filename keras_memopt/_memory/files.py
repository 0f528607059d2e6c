"""The files a `MemoryLogger` writes: checked before the first step (not at the first epoch's
end, when Keras would lose the run's `History`), held while it runs so that no second logger
writes one at the same time."""

from __future__ import annotations

import dataclasses
import os
import threading


def check_path(path, what: str) -> str:
    """`path` made absolute, where a file can be written there; else `ValueError` naming
    `what`, the argument."""
    absolute = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(absolute)
    if not os.path.isdir(folder):
        raise ValueError(
            f"`{what}` must be a file in a folder that exists, and the folder "
            f"{folder} does not. Create it before training, or choose another "
            f"path. Received: {what}={path!r}"
        )
    if os.path.isdir(absolute):
        raise ValueError(
            f"`{what}` must be a file, and {absolute} is a folder. Name a file "
            f"in it instead. Received: {what}={path!r}"
        )
    writable = os.access(absolute, os.W_OK) if os.path.exists(absolute) else None
    if writable is None:
        writable = os.access(folder, os.W_OK)
    if not writable:
        raise ValueError(
            f"`{what}` must be a file this process may write, and {absolute} "
            f"is not (permissions). Choose another path. Received: {what}={path!r}"
        )
    return absolute


@dataclasses.dataclass
class _Claim:
    """A logger's hold on a file for one `fit` call, blocking another logger only while that
    `fit` may still run (a failed `fit` calls no `on_train_end`): one `fit` is told by the
    `params` dict Keras hands all its callbacks; one thread's earlier `fit` has ended; another
    thread's may run while that thread lives."""

    owner: object
    fit: object  # the `params` of the `fit` call that made the claim
    thread: int

    def blocks(self, owner, fit) -> bool:
        if self.owner is owner:
            return False
        if self.fit is fit:
            return True  # two loggers in one fit
        if self.thread == threading.get_ident():
            return False  # that fit has ended, normally or by an exception
        return any(thread.ident == self.thread for thread in threading.enumerate())


# Files loggers are writing, so that a second logger in this process cannot overwrite them mid-run.
_FILES_IN_USE: dict[str, _Claim] = {}


def claim(paths: dict[str, str], owner, fit):
    """Holds every path of `paths` (argument name → absolute path) for `owner`, all or none;
    `FileExistsError` if another logger is writing one."""
    for what, path in paths.items():
        holder = _FILES_IN_USE.get(path)
        if holder is not None and holder.blocks(owner, fit):
            raise FileExistsError(
                f"Another MemoryLogger is writing {path} in this run; two loggers "
                f"cannot share one {what}. Give each its own file. Received: "
                f"{what}={path!r}"
            )
    for path in paths.values():
        _FILES_IN_USE[path] = _Claim(owner, fit, threading.get_ident())


def release(owner):
    """Lets go of every file `owner` holds."""
    for path in [p for p, held in _FILES_IN_USE.items() if held.owner is owner]:
        del _FILES_IN_USE[path]
