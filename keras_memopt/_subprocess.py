"""Runs Python in a fresh process, a fresh TensorFlow, and gets a result back.

TensorFlow reads its allocator settings once, at start, and what a process allocated before changes
what it allocates next: what must be measured from a clean start, or under a memory limit, runs in a
child of its own, started here. `call` runs a `"module:function"` on a JSON payload and returns its
JSON result (one tagged stdout line); `run` returns a command's whole `Output`; `start`/`wait_all`
run children side by side. Output goes to temporary files, not pipes (children that wait for each
other cannot block), and no child outlives the call that started it, on timeout or interrupt."""

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
    """Environment variables that give a child's TensorFlow a GPU-like CPU allocator: the
    BFC allocator reports current and peak bytes and honours `cpu_memory_limit_mb` (MiB);
    oneDNN, which allocates around it (and crashed under a limit), is off. `quiet` silences
    TensorFlow's C++ log."""
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
    """A child process failed, ran out of time, or sent no result; `output`: its `Output`."""

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
        """Waits for the child's `Output`; kills it past `timeout` seconds (`ChildFailed`) or
        on an interrupt (re-raised)."""
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
    """Starts `python *args` and returns at once; `env` is set on top of this process's
    environment (None removes a variable); `name` is what error messages call the child."""
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
    """The value a child sent with `send_result`; `ChildFailed` if it failed or sent none."""
    lines = [line for line in output.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if output.returncode != 0:
        raise ChildFailed(f"{name} exited with status {output.returncode}.", output)
    if not lines:
        raise ChildFailed(f"{name} exited without sending a result.", output)
    return json.loads(lines[-1][len(RESULT_TAG):])


def call(function: str, payload=None, env=None, timeout: float | None = None,
         name: str | None = None):
    """Calls `"package.module:function"` on the JSON `payload` in a fresh Python process and
    returns its JSON result; `ChildFailed` if the child fails, times out or sends none."""
    name = name or f"The child process running {function}"
    output = run(
        ["-c", _CHILD_MAIN, function], env=env, stdin=json.dumps(payload),
        timeout=timeout, name=name,
    )
    return result_of(output, name)


def send_result(value):
    """Sends `value` (JSON-able) to the parent: one tagged line on stdout."""
    # The channel `result_of` reads, not a message: printed whatever the logging settings.
    print(RESULT_TAG + json.dumps(value), flush=True)


def child_main():
    """The child's side of `call`: `python -c ... module:function` with the payload on stdin."""
    module, function = sys.argv[1].split(":")
    payload = json.loads(sys.stdin.read())
    send_result(getattr(importlib.import_module(module), function)(payload))
