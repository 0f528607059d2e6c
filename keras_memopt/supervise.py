"""Supervised training: a crashed training process restarts with a smaller micro-batch.

Some out-of-memory errors kill TensorFlow itself (a SIGSEGV in oneDNN) instead of raising.
`keras-memopt run -- python train.py` restarts a process that died of a signal with every
`AccumulatingModel`'s micro-batch capped at `factor` times the size in use (reported and read
through `_oom.supervised`'s variables) and oneDNN off; one that exits with an error is not
restarted. See docs/oom-backoff.md, "When TensorFlow itself dies"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from keras_memopt._oom.rule import backoff_factor, shrink
from keras_memopt._oom.supervised import (
    CAP_VARIABLE,
    STATE_VARIABLE,
    SizeFile,
    max_micro_batch_size,
)
from keras_memopt._validation import positive_int

__all__ = [
    "CAP_VARIABLE", "ONEDNN_VARIABLE", "STATE_VARIABLE", "SizeFile", "max_micro_batch_size",
    "supervise",
]

ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"

# Exit statuses of a death by these signals (a shell's: 128 + the number; `subprocess`: negative).
_CRASHES = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)


def _crashed(returncode):
    signals = {int(s) for s in _CRASHES}
    return -returncode in signals or returncode - 128 in signals


def _signal_name(returncode):
    number = -returncode if returncode < 0 else returncode - 128
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_size(path):
    try:
        with open(path) as handle:
            return int(json.load(handle)["micro_batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def supervise(
    command: list[str],
    factor: float = 0.5,
    min_micro_batch_size: int = 1,
    max_restarts: int = 5,
    verbose: int = 1,
) -> int:
    """Runs `command`, restarting it with a smaller micro-batch when it crashes.

    Args:
        command: list of str, the training command (`["python", "train.py"]`).
        factor: float in (0, 1), the cap after a crash is this times the micro-batch size in use
            when the process died (rounded down, at least one sample smaller). Defaults to `0.5`.
        min_micro_batch_size: int, the smallest cap; a crash at this size is final, unless the
            restart is the first without oneDNN kernels. Defaults to `1`.
        max_restarts: int, how many restarts at the most. Defaults to `5`.
        verbose: int, 1 to write a line to standard error per restart, and why a crashed process is
            not restarted; 0 for silence. Defaults to `1`.

    Returns:
        The training process's last exit status (0 when it trained), 130 when interrupted.

    Raises:
        ValueError: for an empty `command` or an invalid argument.
        FileNotFoundError: if the command is not found (`OSError` if it cannot be run otherwise).
    """
    if not command:
        raise ValueError("`command` must name the training command. Received: command=[]")
    factor = backoff_factor(factor)
    positive_int("min_micro_batch_size", min_micro_batch_size)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(
            "`max_restarts` must be a non-negative integer. "
            f"Received: max_restarts={max_restarts!r}"
        )
    with tempfile.TemporaryDirectory(prefix="keras-memopt-run-") as folder:
        state = os.path.join(folder, "state.json")
        env = {**os.environ, STATE_VARIABLE: state}
        restarts = 0
        while True:
            returncode = _run(command, env, verbose)
            if returncode == 0 or not _crashed(returncode):
                return returncode
            size = _last_size(state)
            if size is not None and CAP_VARIABLE in env:
                # A process that died before its first step reported nothing new.
                size = min(size, int(env[CAP_VARIABLE]))
            # Most crashes are in oneDNN kernels: a restart runs without them.
            onednn_newly_off = ONEDNN_VARIABLE not in env
            why = _why_not_restart(restarts, max_restarts, size, min_micro_batch_size,
                                   onednn_newly_off)
            if why:
                _say(
                    verbose,
                    f"the training process died of {_signal_name(returncode)} {why}; "
                    "not restarting.",
                )
                return returncode
            cap = shrink(size, factor, min_micro_batch_size)
            env[CAP_VARIABLE] = str(cap)
            env.setdefault(ONEDNN_VARIABLE, "0")
            restarts += 1
            onednn = " and oneDNN kernels off (TF_ENABLE_ONEDNN_OPTS=0)" * onednn_newly_off
            _say(
                verbose,
                f"the training process died of {_signal_name(returncode)} "
                f"at micro_batch_size={size}; restarting it (restart {restarts} of at most "
                f"{max_restarts}) with micro_batch_size at most {cap}{onednn}.",
            )


def _why_not_restart(restarts, max_restarts, size, min_micro_batch_size, onednn_newly_off):
    """Why a crashed process is not restarted, or `None` when it is."""
    if restarts >= max_restarts:
        return f"after {restarts} restarts"
    if size is None:
        return "before any training step"
    if size <= min_micro_batch_size and not onednn_newly_off:
        return f"at the smallest micro-batch allowed ({size})"
    return None


def _say(verbose, message):
    """A message of `keras-memopt run`'s, to standard error (see the module's docstring)."""
    if verbose:
        sys.stderr.write(f"keras-memopt run: {message}\n")
        sys.stderr.flush()


def _run(command, env, verbose):
    """Runs `command` to its end; on Ctrl-C stops it and returns 130."""
    process = subprocess.Popen(command, env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _say(verbose, "interrupted.")
        return 130
