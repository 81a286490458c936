"""The processes the trainer starts (SGLang servers, a judge's server, the pool's ``torch_shm_manager``) go from fork
straight to exec: no Python runs in the forked child, where CPython would first free the trainer's other threads'
states and could wait forever on a lock held by a thread that the child does not have (seen: a forked child stuck in
a gloo process group's destructor). They still die with the trainer: ``dying_with_parent`` sets the parent-death
signal in the started interpreter, then execs the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lit_parl.rollout.processes import dying_with_parent

# a trainer that marks every forked child in which Python runs, then starts what lit_parl starts
LAUNCHES = """
import os, sys, tempfile, threading
marker = sys.argv[1]
os.register_at_fork(after_in_child=lambda: open(marker, "a").write(f"{os.getpid()}\\n"))
threading.Thread(target=threading.Event().wait, daemon=True).start()  # a threaded trainer
from lit_parl.rollout.shm_manager import ShmManager
from lit_parl.rollout.sglang.servers import ServerFleet, stop_launched
manager = ShmManager()
assert manager.handle().startswith(b"/")
manager.stop()
workdir = tempfile.mkdtemp()
fleet = ServerFleet(workdir)
server = fleet.launch_server(["sleep", "30"], dict(os.environ), "http://127.0.0.1:1", "server.log")
assert server.process.poll() is None
stop_launched(fleet.launched, workdir)
print("launched", flush=True)
"""


def test_starting_a_server_or_the_shm_manager_runs_no_python_in_the_forked_child(tmp_path):
    marker = tmp_path / "forked_children_that_ran_python"
    result = subprocess.run([sys.executable, "-c", LAUNCHES, str(marker)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "launched" in result.stdout, result.stderr[-3000:]
    assert not marker.exists(), f"Python ran in a forked child of the trainer: {marker.read_text()}"


def test_a_command_started_dying_with_parent_dies_with_the_trainer():
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "from lit_parl.rollout.processes import dying_with_parent\n"
            "child = subprocess.Popen(dying_with_parent(['sleep', '60']))\n"
            "print(child.pid, flush=True)\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(trainer.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{child}/cmdline").read().split("\0")[0] != "sleep" and time.monotonic() < deadline:
            time.sleep(0.05)  # the interpreter has not exec'd the command yet
        assert open(f"/proc/{child}/cmdline").read().split("\0")[0] == "sleep"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.1)
        state = open(f"/proc/{child}/stat").read().split(")")[1].split()[0] if os.path.exists(f"/proc/{child}") else ""
        assert state in ("", "Z"), "the command outlived the trainer that started it"
    finally:
        trainer.kill()
        trainer.wait()


def test_a_command_whose_parent_died_before_the_signal_was_set_does_not_run():
    command = dying_with_parent(["sh", "-c", "echo ran"])
    command[command.index(str(os.getpid()))] = "1"  # as if re-parented: the trainer is gone
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "ran" not in result.stdout
