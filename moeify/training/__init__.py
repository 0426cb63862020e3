"""What the tune stage trains with, below it (moeify.tuning imports these; they import no stage).

    distill.py   whole-model distillation of a carved MoE towards its dense source: the step, tensors in and out
    kl.py        the tuning loss: chunked KL(teacher || student) from final hidden states
    steps.py     a run's parts both trainers share: forwards, the window stream, a saved state's tensors, the best
                 weights kept on disk, the frozen modules shared with the teacher
    sampling.py  the dense model's own text: continuations sampled from the model itself
    parallel.py  training across processes: torch.distributed with FSDP2 (torchrun, accelerate launch)
"""
