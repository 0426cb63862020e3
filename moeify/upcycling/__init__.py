"""The upcycle stage, `moeify upcycle`: an MoE whose experts are copies of each dense FFN.

    upcycle.py   the stage: plan (headers only, every refusal), per layer copies streamed out, checked, committed
    check.py     the end-of-run check: the written MoE against the source, a decoder layer at a time
    copies.py    its maths: the copies, their routers, the ways to break their symmetry (pure)
"""
