"""Run a module's ranks as torchrun would, but forked from one process that has imported torch and Megatron-Core.

Importing torch and Megatron-Core costs about 9 s of CPU per process, most of what a tiny model's launch takes
(a one-rank oracle load, on a busy 2-core machine: 13 s of CPU under torchrun; forked, under 2 s from request to
answer, with the same loss and logits). `run` has the signature of
`fixtures.torchrun.run`; each rank is a fresh fork of a server that imported those packages and nothing else ran
in, so every run starts from the state a new process would, with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) and `python -m module args`'s `__main__`. Tests that are about the
launch itself (torchrun's output, a rank killed and the others stopped by the launcher) keep `fixtures.torchrun`.

The server (`python -m tests.launch`, one per test process, started on first use) reads one JSON request per line
on stdin and answers one line: each rank's exit status. When a rank fails, the others are killed, as torchrun does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from fixtures.torchrun import REPO, pythonpath

# What the entry points under fixtures/ and the trainer import; the module itself is run fresh in each rank.
WARM = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.dist_checkpointing",
        "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel", "reshard.trainer.model"]


class _Server:
    def __init__(self) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="reshard-launch-"))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=pythonpath())
        self.stderr = open(self.logs / "server.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.launch"], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the launch server ended: {(self.logs / 'server.log').read_text()[-6000:]}")
        return json.loads(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.stderr.close()
        shutil.rmtree(self.logs, ignore_errors=True)


_server: _Server | None = None


def run(module: str, args: list, nproc: int, timeout: float = 300, env: dict | None = None) -> None:
    """`python -m torch.distributed.run --nproc_per_node N -m module args`, forked. Raises RuntimeError with
    the tail of the ranks' output (rank by rank) when a rank fails or the run times out."""
    global _server
    if _server is None:
        _server = _Server()
        atexit.register(_server.close)
    logs = _server.logs / uuid.uuid4().hex
    logs.mkdir()
    answer = _server.ask({"module": module, "argv": list(map(str, args)), "nproc": nproc, "timeout": timeout,
                          "env": {k: str(v) for k, v in (env or {}).items()}, "logs": str(logs)})
    codes = answer["codes"]
    if answer["timed_out"] or any(codes):
        # Drop megatron's import-time warnings so the rank's own traceback stays in the tail.
        lines = [line for r in range(nproc) for line in (logs / f"rank{r}.log").read_text(errors="replace").splitlines()
                 if "warn" not in line.lower()]
        what = f"timed out after {timeout}s" if answer["timed_out"] else f"exit statuses {codes}"
        raise RuntimeError(f"{what}: python -m {module} {' '.join(map(str, args))} ({nproc} forked ranks)\n" + "\n".join(lines)[-8000:])
    shutil.rmtree(logs)


def free_port() -> int:
    """A port no process listens on now (the kernel's pick), for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(request: dict, rank: int, launch: dict) -> None:
    """In the forked child: become rank `rank` and run the module as `python -m` does; never returns."""
    import atexit
    import runpy

    os.setpgid(0, 0)  # a group of its own (the parent sets it too, whichever runs first), so that killing it reaches its children
    os.environ.update(launch, RANK=str(rank), LOCAL_RANK=str(rank), **request["env"])
    log = os.open(Path(request["logs"]) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1), os.dup2(log, 2), os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    status = 1
    try:
        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exc:  # as the interpreter does: an int is the status, anything else is printed
        status = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as an uncaught exception: init_process_group's hook prefixes "[rankN]: "
    finally:
        atexit._run_exitfuncs()  # what the interpreter's exit would run; the server's own exit must not run here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _launch(request: dict) -> dict:
    n = request["nproc"]
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
              "GROUP_RANK": "0", "ROLE_RANK": "0", "TORCHELASTIC_RUN_ID": uuid.uuid4().hex}
    ranks = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank, launch)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the child may have set it, or ended, already
            os.setpgid(pid, pid)
        ranks[pid] = rank
    codes: dict[int, int] = {}
    deadline, stopped, timed_out = time.monotonic() + request["timeout"], False, False
    while len(codes) < n:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            continue
        timed_out = timed_out or time.monotonic() > deadline
        if not stopped and (timed_out or any(codes.values())):  # as torchrun does: one rank failed, the others are stopped
            for other, rank in ranks.items():
                if rank not in codes:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(other, signal.SIGKILL)
            stopped = True
        time.sleep(0.01)
    return {"codes": [codes[r] for r in range(n)], "timed_out": timed_out}


def serve() -> None:
    import importlib

    for name in WARM:
        importlib.import_module(name)
    for line in sys.stdin:
        print(json.dumps(_launch(json.loads(line))), flush=True)


if __name__ == "__main__":
    serve()
