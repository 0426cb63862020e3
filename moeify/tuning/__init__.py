"""Recovery tuning as a stage: `moeify tune SRC OUT` and the tuning step of `moeify convert --tune-tokens N`.

The stage distils a moeify output (tuned or not) towards its dense source and writes the result back all or nothing,
as convert writes its output. Everything the student needs is read from OUT (the expert tensors, routers and each
layer's neuron permutation in report.json) and SRC (the teacher), so an output can be tuned further at any later
time, and `convert` runs the same code on the carve it has just written. The step itself (the masked MoE student,
the KL, the optimizer loop) is moeify.training.distill: tensors in, tensors out.

One job a module, in the order a run meets them (each imports only those below it; pyproject.toml's import-linter
contracts check it):

    run.py       a run from start to end: check_run refuses every bad input before any work, then the state
                 directory, teacher, tuning text, teacher pass, distillation and the all-or-nothing write
    dry_run.py   `tune --dry-run`: the same checks, a few steps timed, the whole run's time and memory estimated
    sizing.py    memory: whether the run fits the device, whether the student's state is offloaded, the peak
    student.py   the student: built on the teacher's frozen modules, sharded as built, gathered after
    teacher.py   the teacher: loaded (sharded across processes), its pass over the real windows, its FFNs freed
    data.py      the tuning text: real windows, the dense model's own sampled windows, their kept targets
    output.py    the base output read and checked against the source; the tuned output written
    state.py     the resumable state in OUT.moeify-tune/ (its files, atomic saves, signals, lock, fingerprints)
                 and its checks on --resume
    options.py   what a run is asked to do (TuneOptions) and the interruption a signal turns into

    lm.py        beside run.py: next-token training of an upcycled or merged output (`moeify tune OUT`), with
                 Mixtral's load-balancing loss and the expert load reported; the same state directory, signals
                 and processes (torchrun: checks agreed, phases met, rank 0 writing)
    lm_loop.py   beside sizing.py: its loop (the model whole or sharded by FSDP2, windows split by rank, the
                 load summed over the ranks, snapshots)
    lm_weights.py  below it: the model built on the meta device, each rank reading only its shards from OUT;
                 the output gathered and written one parameter at a time
    lm_options.py  beside options.py: what such a run is asked to do (TrainOptions) and its routing measures
    across.py    beside options.py: either run on every rank seen from outside (run.py's and lm.py's): its
                 errors as the user is told them, its process group closed

Resumable: the run's whole state lives in `OUT.moeify-tune/` (state.py describes its files), saved atomically;
`--resume` continues from it and ends with the weights an uninterrupted run would have (same machine and thread
count).
"""

from .dry_run import estimate_run
from .options import TuneOptions, TuningInterrupted, options_from_config
from .output import read_output
from .run import tune_output
from .state import TuningState, refuse_leftover_state, resume_command, state_dir
from .student import build_student

__all__ = ["TuneOptions", "TuningInterrupted", "TuningState", "build_student", "estimate_run", "options_from_config",
           "read_output", "refuse_leftover_state", "resume_command", "state_dir", "tune_output"]
