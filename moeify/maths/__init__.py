"""The maths: pure functions (tensors or numbers in, results out, no I/O), and the student's MoE block.

    moe_block.py   the student's MoE block: a carved FFN as the exported format computes it
    router.py      router rows from gate_proj rows, the unit-gate router scale
    partition.py   FFN weights -> a permutation of the intermediate neurons and its cut into experts
    numerics.py    low-level helpers shared by the stages (devices, activations, neuron statistics)
    layerfit.py    layer-local fitting of a carved FFN (--fit-epochs)
    budget.py      parameter and FLOP accounting
    memory.py      peak memory of tuning and training per process, predicted from the config alone
    stats.py       the statistics of paired comparisons
"""
