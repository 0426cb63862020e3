"""`python -m moeify ...` with ranks held back, for the multi-process tests (tests/test_parallel_runs.py): run under
torchrun as `torchrun --nproc-per-node 2 tests/held_back.py tune SRC OUT ...`.

MOEIFY_TEST_HOLD lists what to do, entries separated by ';', each RANK|PHASE|WHAT[|before]:
- PHASE: a phase the ranks meet at (moeify.training.parallel.Parallel.arrive: 'the tuning text', 'the teacher pass',
  'the tuning loop', 'the training loop', 'saving a snapshot', 'writing the output', ...), or 'step N' (the N-th
  training step, counted from 1 in this process: a carve's tuning step or an upcycle's training step);
- WHAT: seconds to sleep there, 'forever', or 'kill' (SIGKILL of this rank);
- at a phase the hold is after this rank arrived (the others go on into the phase first: the races a late rank
  meets), or before it arrives with '|before' (the others wait for it).
Each entry applies once, the first time its rank reaches its phase. MOEIFY_TEST_PIDS: a folder where each rank
writes its pid to a file named by its rank. MOEIFY_TEST_REFUSE=RANK|MESSAGE: that rank alone refuses its inputs
(moeify.tuning.run.check_run raises MoeifyError(MESSAGE)).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def _entries() -> list[list[str]]:
    spec = os.environ.get("MOEIFY_TEST_HOLD", "")
    return [e.split("|") for e in spec.split(";") if e.strip()]


def _hold(what: str) -> None:
    sys.stderr.write(f"held_back: rank {os.environ.get('RANK')} holds: {what}\n")
    sys.stderr.flush()
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    end = time.monotonic() + (1e9 if what == "forever" else float(what))
    while time.monotonic() < end:  # a sleep that a handled signal does not end early (PEP 475 resumes it too)
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))


def main() -> None:
    import moeify.training.distill as distill
    from moeify.training import parallel
    from moeify.cli.app import main as cli_main

    rank = os.environ.get("RANK", "0")
    if os.environ.get("MOEIFY_TEST_PIDS"):  # a folder: each rank's pid in a file named by its rank
        pids = Path(os.environ["MOEIFY_TEST_PIDS"])
        pids.mkdir(exist_ok=True)
        (pids / rank).write_text(str(os.getpid()))
    todo = [e for e in _entries() if e[0] == rank]
    arrive, kl = parallel.Parallel.arrive, distill.accumulate_kl
    steps = [0]

    def held_arrive(self, phase: str, then: str | None = None) -> None:
        mine = next((e for e in todo if e[1] == phase), None)
        if mine is not None:
            todo.remove(mine)
            if mine[3:] == ["before"]:
                _hold(mine[2])
                return arrive(self, phase, then)
            arrive(self, phase, then)
            return _hold(mine[2])
        return arrive(self, phase, then)

    def held(step_fn):
        def held_step(*args, **kwargs):
            steps[0] += 1
            mine = next((e for e in todo if e[1] == f"step {steps[0]}"), None)
            if mine is not None:
                todo.remove(mine)
                _hold(mine[2])
            return step_fn(*args, **kwargs)
        return held_step

    held_kl = held(kl)

    parallel.Parallel.arrive = held_arrive
    distill.accumulate_kl = held_kl
    import moeify.tuning.lm_loop as lm_loop  # next-token training's step (an upcycle or merge): held the same way

    lm_loop.train_step = held(lm_loop.train_step)
    refuse = os.environ.get("MOEIFY_TEST_REFUSE", "")  # RANK|MESSAGE: that rank alone refuses its inputs
    if refuse.split("|")[0] == rank:
        import moeify.tuning.run as run_module
        from moeify.errors import MoeifyError

        def refusing_check(*args, **kwargs):
            raise MoeifyError(refuse.split("|", 1)[1], "the test's refusal")

        run_module.check_run = refusing_check
    sys.argv = ["moeify", *sys.argv[1:]]
    cli_main()


if __name__ == "__main__":
    main()
