"""Runs Python in a fresh process, a fresh TensorFlow, and gets a result back.

TensorFlow reads its allocator settings once, when it starts, and what a
process allocated before changes what it allocates next; so whatever must be
measured from a clean start, or run under a memory limit, runs in a child
process of its own. This module is the one way keras_memopt (and its tests)
start one:

- `call("package.module:function", payload, env=...)`: the child imports
  `function`, calls it with the JSON `payload` and sends its JSON-able return
  value back as one tagged line on stdout; `call` returns that value, or
  raises `ChildFailed` with the tail of the child's output.
- `run([...python arguments...], env=...)`: any Python command line; its
  whole output comes back (`Output`) for callers that read it themselves.
- `start(...)` returns at once with a `Child`, so that several children (the
  workers of one cluster) run side by side; `wait_all` collects them.

A child's output goes to temporary files, not pipes, so children that wait
for each other cannot block on a full pipe. Every child is killed when its
time runs out and when the caller is interrupted (`KeyboardInterrupt`): none
outlives the call that started it.

Example:

```python
result = call(
    "keras_memopt.planning.measure:measure_in_child",
    spec,
    env=tensorflow_env(cpu_memory_limit_mb=600),
    timeout=600,
)
```
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

RESULT_TAG = "KERAS_MEMOPT_RESULT "
_CHILD_MAIN = "from keras_memopt._subprocess import child_main; child_main()"
_TAIL = 3000


def tensorflow_env(cpu_memory_limit_mb: int | None = None, quiet: bool = True) -> dict[str, str]:
    """Environment variables that give a child's TensorFlow a GPU-like CPU allocator.

    TensorFlow's BFC allocator on the CPU reports current and peak bytes
    (`tf.config.experimental.get_memory_info("CPU:0")`) and honours a memory
    limit; oneDNN is turned off because it allocates around that allocator
    (and crashed under a limit).

    Args:
        cpu_memory_limit_mb: int, the CPU allocator's limit in MiB. Defaults
            to None (the inherited limit, or TensorFlow's default).
        quiet: bool, whether to silence TensorFlow's C++ log lines. Defaults
            to True.
    """
    env = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    if cpu_memory_limit_mb is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(int(cpu_memory_limit_mb))
    if quiet:
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


@dataclasses.dataclass
class Output:
    """What a finished child left: its exit status and its whole output."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def tail(self, chars: int = _TAIL) -> str:
        """The end of the child's stdout and stderr, for an error message."""
        parts = []
        for name, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            if text.strip():
                cut = text if len(text) <= chars else "..." + text[-chars:]
                parts.append(f"--- {name} ---\n{cut.rstrip()}")
        return "\n".join(parts) or "(no output)"


class ChildFailed(RuntimeError):
    """A child process failed, ran out of time, or sent no result.

    Attributes:
        output: the child's `Output` (None where it never started).
    """

    def __init__(self, message: str, output: Output | None = None):
        if output is not None:
            message = f"{message}\n{output.tail()}"
        super().__init__(message)
        self.output = output


def _environment(env):
    merged = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = str(value)
    return merged


class Child:
    """A Python process started by `start()`; `wait()` for its `Output`."""

    def __init__(self, args, env=None, stdin=None, name=None):
        self.args = [sys.executable, *args]
        self.name = name or "a Python child process"
        self._files = [tempfile.TemporaryFile("w+", encoding="utf-8") for _ in range(2)]
        source = subprocess.DEVNULL
        if stdin is not None:
            source = tempfile.TemporaryFile("w+", encoding="utf-8")
            source.write(stdin)
            source.seek(0)
            self._files.append(source)
        self.process = subprocess.Popen(
            self.args,
            stdin=source,
            stdout=self._files[0],
            stderr=self._files[1],
            env=_environment(env),
            text=True,
        )

    def wait(self, timeout: float | None = None) -> Output:
        """Waits for the child to exit and returns its `Output`.

        Raises:
            ChildFailed: if it runs past `timeout` seconds (it is killed).
            KeyboardInterrupt: re-raised after killing the child.
        """
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ChildFailed(
                f"{self.name} did not finish within {timeout:.0f} s and was stopped.",
                self._output(),
            ) from None
        except BaseException:
            self.kill()
            raise
        return self._output()

    def kill(self):
        """Stops the child now (if it still runs) and reaps it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _output(self):
        texts = []
        for file in self._files[:2]:
            file.seek(0)
            texts.append(file.read())
        return Output(self.args[1:], self.process.returncode, *texts)

    def close(self):
        self.kill()
        for file in self._files:
            file.close()


def start(args, env=None, stdin: str | None = None, name: str | None = None) -> Child:
    """Starts `python *args` and returns at once.

    Args:
        args: list of str, the arguments after the Python executable (for
            example `["-c", code]` or `["-m", "module"]`).
        env: dict, variables set (a value of None removes one) on top of this
            process's environment. Defaults to None (inherited as is).
        stdin: str, the child's standard input. Defaults to None (empty).
        name: str, what error messages call the child.
    """
    return Child(list(args), env=env, stdin=stdin, name=name)


def wait_all(children: list[Child], timeout: float | None = None) -> list[Output]:
    """Waits for every child (at most `timeout` seconds in all); kills them all on failure."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        outputs = []
        for child in children:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.01)
            outputs.append(child.wait(left))
        return outputs
    finally:
        for child in children:
            child.close()


def run(args, env=None, stdin: str | None = None, timeout: float | None = None,
        name: str | None = None) -> Output:
    """Runs `python *args` to its end and returns its `Output` (see `start`)."""
    return wait_all([start(args, env=env, stdin=stdin, name=name)], timeout)[0]


def result_of(output: Output, name: str = "The child process"):
    """The value a child sent with `send_result`.

    Raises:
        ChildFailed: if it exited with a non-zero status or sent no result.
    """
    lines = [line for line in output.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if output.returncode != 0:
        raise ChildFailed(f"{name} exited with status {output.returncode}.", output)
    if not lines:
        raise ChildFailed(f"{name} exited without sending a result.", output)
    return json.loads(lines[-1][len(RESULT_TAG):])


def call(function: str, payload=None, env=None, timeout: float | None = None,
         name: str | None = None):
    """Calls `function(payload)` in a fresh Python process and returns its result.

    Args:
        function: str, `"package.module:function"`; it takes the JSON-decoded
            payload and returns a JSON-able value.
        payload: a JSON-able value. Defaults to None.
        env: dict, variables set on top of this process's environment (see
            `tensorflow_env`). Defaults to None.
        timeout: float, seconds before the child is killed. Defaults to None.
        name: str, what error messages call the child.

    Raises:
        ChildFailed: if the child fails, runs out of time or sends no result.
    """
    name = name or f"The child process running {function}"
    output = run(
        ["-c", _CHILD_MAIN, function], env=env, stdin=json.dumps(payload),
        timeout=timeout, name=name,
    )
    return result_of(output, name)


def send_result(value):
    """Sends `value` (JSON-able) to the parent: one tagged line on stdout."""
    # Not a message to the user: the child-to-parent channel that `result_of`
    # reads, so it is printed whatever the logging settings.
    print(RESULT_TAG + json.dumps(value), flush=True)


def child_main():
    """The child's side of `call`: `python -c ... module:function` with the payload on stdin."""
    module, function = sys.argv[1].split(":")
    payload = json.loads(sys.stdin.read())
    send_result(getattr(importlib.import_module(module), function)(payload))
