"""`keras_memopt._subprocess`: fresh Python processes, their results, and no leftovers."""

import os
import signal
import sys
import time

import pytest

from keras_memopt import _subprocess

pytestmark = pytest.mark.line_independent


def double(payload):
    """Called in a child by `test_call_returns_the_functions_result`."""
    return {"doubled": [2 * value for value in payload["values"]], "pid": os.getpid()}


class TestCall:
    def test_call_returns_the_functions_result(self, monkeypatch):
        tests = os.path.dirname(os.path.abspath(__file__))
        result = _subprocess.call(
            "test_subprocess:double",
            {"values": [1, 2.5]},
            env={"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])},
            timeout=300,
        )
        assert result["doubled"] == [2, 5.0]
        assert result["pid"] != os.getpid()

    def test_result_is_the_last_tagged_line(self):
        output = _subprocess.run(
            ["-c", "print('noise'); print('KERAS_MEMOPT_RESULT [1]'); "
                   "print('KERAS_MEMOPT_RESULT {\"a\": 2}'); print('more noise')"],
            timeout=60,
        )
        assert _subprocess.result_of(output) == {"a": 2}

    def test_failure_raises_with_the_childs_output(self):
        output = _subprocess.run(
            ["-c", "import sys; print('half way'); sys.exit('broken: the reason')"], timeout=60
        )
        assert output.returncode == 1
        with pytest.raises(_subprocess.ChildFailed, match=r"(?s)exited with status 1.*"
                           r"half way.*broken: the reason") as raised:
            _subprocess.result_of(output, "The child")
        assert raised.value.output is output

    def test_no_result_line_is_a_failure(self):
        output = _subprocess.run(["-c", "print('nothing tagged')"], timeout=60)
        with pytest.raises(_subprocess.ChildFailed, match="without sending a result"):
            _subprocess.result_of(output)


class TestRun:
    def test_environment_is_set_and_removed(self, monkeypatch):
        monkeypatch.setenv("KMO_TEST_REMOVED", "present")
        output = _subprocess.run(
            ["-c", "import os; print(os.environ.get('KMO_TEST_SET'), "
                   "os.environ.get('KMO_TEST_REMOVED'))"],
            env={"KMO_TEST_SET": 7, "KMO_TEST_REMOVED": None},
            timeout=60,
        )
        assert output.stdout.split() == ["7", "None"]

    def test_stdin_reaches_the_child(self):
        text = "x" * 200_000  # larger than a pipe's buffer
        output = _subprocess.run(
            ["-c", "import sys; print(len(sys.stdin.read()))"], stdin=text, timeout=60
        )
        assert output.stdout.strip() == str(len(text))

    def test_timeout_kills_the_child(self, tmp_path):
        pid_file = tmp_path / "pid"
        code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); " \
               "print('started', flush=True); time.sleep(120)"
        started = time.monotonic()
        with pytest.raises(_subprocess.ChildFailed, match=r"(?s)within 2 s and was stopped.*"
                           "started"):
            _subprocess.run(["-c", code], timeout=2, name="The sleeper")
        assert time.monotonic() - started < 60
        _assert_gone(int(pid_file.read_text()))

    def test_interrupt_kills_the_child(self):
        child = _subprocess.start(["-c", "import time; time.sleep(120)"])
        wait = child.process.wait
        calls = []

        def interrupted_once(timeout=None):  # Ctrl-C while the parent waits
            calls.append(timeout)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return wait(timeout)

        child.process.wait = interrupted_once
        with pytest.raises(KeyboardInterrupt):
            child.wait(30)
        assert child.process.returncode == -signal.SIGKILL  # killed, and reaped
        child.close()

    def test_children_run_side_by_side(self, tmp_path):
        # Each child waits for the other's file: one after the other, neither could finish.
        code = (
            "import os, sys, time\n"
            "mine, theirs = sys.argv[1:]\n"
            "open(mine, 'w').close()\n"
            "deadline = time.time() + 60\n"
            "while not os.path.exists(theirs) and time.time() < deadline: time.sleep(0.05)\n"
            "print('met' if os.path.exists(theirs) else 'alone')\n"
        )
        a, b = str(tmp_path / "a"), str(tmp_path / "b")
        children = [_subprocess.start(["-c", code, a, b]), _subprocess.start(["-c", code, b, a])]
        outputs = _subprocess.wait_all(children, timeout=120)
        assert [o.stdout.strip() for o in outputs] == ["met", "met"]
        assert [o.returncode for o in outputs] == [0, 0]


def test_tensorflow_env():
    env = _subprocess.tensorflow_env(cpu_memory_limit_mb=160)
    assert env == {
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": "160",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB" not in _subprocess.tensorflow_env(quiet=False)


def _assert_gone(pid):
    if sys.platform == "win32":
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    # A zombie is gone too, but a reaped child leaves none.
    pytest.fail(f"process {pid} still exists")


def test_benchmarks_set_the_same_allocator_variables():
    # benchmarks/_common.py writes them out: it must not start TensorFlow.
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "_common.py")
    spec = importlib.util.spec_from_file_location("benchmarks_common", path)
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert common.ALLOCATOR_ENV == _subprocess.tensorflow_env(cpu_memory_limit_mb=8192)
