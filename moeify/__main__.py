"""`python -m moeify ...` (and `torchrun --nproc-per-node G -m moeify tune ...`): the moeify command line."""

from .cli.app import main

main()
