"""The merge stage (above upcycling): one MoE from several fine-tunes of one base.

    merge.py     the merge: the request over a mergekit-moe YAML, the sources checked, the router rows by gate mode,
                 then the upcycle stage's writer
    spec.py      a mergekit-moe YAML as `moeify merge --config` reads it, checked; the gate modes
"""
