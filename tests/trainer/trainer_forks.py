"""Runs of the trainer forked from one process that has imported it: `python -m tests.trainer.trainer_forks`.

Each line read from stdin is a JSON object: `argv`, the trainer's arguments, and optionally `watch`, a path, and
`kill_after`, seconds. The process forks a child that runs `reshard.trainer.train.main` on them as a one-process
job (gloo, its own port); once `watch` exists it sends the child SIGKILL `kill_after` seconds later, unless the
child has ended. It prints a JSON line: the child's exit status (negative: the signal that ended it) and the
seconds from `watch` appearing to the child's end. Importing torch and Megatron-Core is most of a small run's
time; a test that runs the trainer 40 times pays for it once. (The child is killed here, by its parent, so that
its pid cannot have been reused by another process.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from reshard.trainer.train import main  # noqa: E402  after the thread count is set
from tests.launch import free_port  # noqa: E402


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        port = free_port()
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            status = 1
            try:
                main(request["argv"])
                status = 0
            finally:
                os._exit(status)
        code, seen = None, None
        watch, kill_after = request.get("watch"), request.get("kill_after")
        while code is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            elif watch is not None and seen is None and os.path.exists(watch):
                seen = time.monotonic()
            elif seen is not None and kill_after is not None and time.monotonic() - seen >= kill_after:
                os.kill(pid, signal.SIGKILL)
                kill_after = None
            else:
                time.sleep(0.002)
        print(json.dumps({"status": code, "after_watch": None if seen is None else time.monotonic() - seen}), flush=True)


if __name__ == "__main__":
    serve()
