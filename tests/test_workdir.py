"""One run per workdir: the lock refuses a live run, names it, and takes over a dead one."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from etils import epath

from jaxmoe.errors import ConfigError
from jaxmoe.training.workdir import LOCK_NAME, WorkdirInUse, WorkdirLock, check_workdir


def test_second_run_is_refused_naming_the_first(tmp_path):
    workdir = check_workdir(str(tmp_path / "run"))
    with WorkdirLock(workdir), pytest.raises(WorkdirInUse) as info:
        WorkdirLock(workdir).acquire()
    message = str(info.value)
    assert "\n" not in message
    assert (
        f"host {socket.gethostname()}" in message and f"pid {__import__('os').getpid()}" in message
    )
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released on exit


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_lock_of_a_killed_run_on_this_host_is_taken_over(tmp_path, caplog):
    workdir = epath.Path(tmp_path)
    stale = {"host": socket.gethostname(), "pid": _dead_pid(), "started": 1.0, "heartbeat": 1.0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    with WorkdirLock(workdir):
        held = json.loads((tmp_path / LOCK_NAME).read_text())
        assert held["pid"] != stale["pid"]
    assert "taking over the lock of a run that is gone" in caplog.text


def test_torn_lock_file_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"host": "a", "pi')  # killed mid-write
    with WorkdirLock(epath.Path(tmp_path)):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == socket.gethostname()


def test_other_hosts_lock_counts_while_its_heartbeat_is_fresh(tmp_path):
    now = time.time()
    other = {"host": "some-other-host", "pid": 1, "started": now - 30, "heartbeat": now - 30}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(WorkdirInUse, match="host some-other-host, pid 1"):
        WorkdirLock(epath.Path(tmp_path), stale_after_s=600).acquire()
    other["heartbeat"] = now - 601  # that host stopped beating ten minutes ago
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    with WorkdirLock(epath.Path(tmp_path), stale_after_s=600):
        pass


def test_live_process_holding_the_lock_is_not_mistaken_for_dead(tmp_path):
    code = (
        "import sys, time; from etils import epath\n"
        "from jaxmoe.training.workdir import WorkdirLock\n"
        "lock = WorkdirLock(epath.Path(sys.argv[1])); lock.acquire(); print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirInUse, match=f"pid {holder.pid}"):
            WorkdirLock(epath.Path(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()
    with WorkdirLock(epath.Path(tmp_path)):  # killed: its lock is free again
        pass


@pytest.mark.parametrize(
    "text, why",
    [
        ("null", "not a JSON object: 'null'"),
        ("[1, 2, 3]", "not a JSON object: '[1, 2, 3]'"),
        ('"locked"', "not a JSON object: '\"locked\"'"),
        ('{"host": "h", "pid": 4242, "started": 1.0, "heartbeat": "yesterday"}',
         "heartbeat='yesterday' is not a time"),
        ('{"host": "h", "pid": 4242, "started": 1.0, "heartbeat": NaN}',
         "heartbeat=nan is not a time"),
        ('{"host": "HOST", "pid": "abc", "started": 1.0, "heartbeat": 1.0}',
         "pid='abc' is not a process id"),
        ('{"host": null, "pid": 1, "started": 1.0, "heartbeat": 1.0}',
         "host=None is not a host name"),
    ],
    ids=["null", "list", "string", "heartbeat_text", "heartbeat_nan", "pid_text", "host_null"],
)  # fmt: skip
def test_lock_no_run_wrote_is_taken_over_saying_why(tmp_path, caplog, text, why):
    """A lock file that is not what jaxmoe writes is no live run's: taken over with one
    warning naming the file and the field, never a traceback or a false "in use"."""
    lock = tmp_path / LOCK_NAME
    lock.write_text(text.replace("HOST", socket.gethostname()))
    with WorkdirLock(epath.Path(tmp_path)):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (
        f"workdir {tmp_path}: taking over the lock of a run that is gone ({lock}: {why})"
    )


def test_lock_that_is_a_directory_or_a_fifo_is_one_line(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(ConfigError) as refused:
        WorkdirLock(epath.Path(tmp_path)).acquire()
    assert str(refused.value) == (
        f"{tmp_path / LOCK_NAME} is a directory, not the lock file jaxmoe keeps there: "
        f"remove it to use workdir {str(tmp_path)!r}"
    )
    (tmp_path / LOCK_NAME).rmdir()
    os.mkfifo(tmp_path / LOCK_NAME)  # would block a reader forever: taken over, unread
    with WorkdirLock(epath.Path(tmp_path)):
        assert (tmp_path / LOCK_NAME).is_file()


def test_lock_with_a_heartbeat_in_the_future_says_so(tmp_path):
    """Another host's clock running ahead keeps its lock fresh for years: refused, saying
    so and how to free the workdir."""
    ahead = time.time() + 3e8
    record = {"host": "fast-clock", "pid": 4242, "started": ahead, "heartbeat": ahead}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    with pytest.raises(WorkdirInUse) as refused:
        WorkdirLock(epath.Path(tmp_path)).acquire()
    message = str(refused.value)
    assert "host fast-clock, pid 4242" in message
    assert "s in the future: that host's clock runs ahead" in message
    assert message.endswith(f"(if no run uses it, remove {tmp_path / LOCK_NAME})")
