"""The upcycle stage, `moeify upcycle`: an MoE whose experts are copies of each dense FFN.

    upcycle.py   the stage: plan (headers only, every refusal), per layer copies streamed out, the logit check
    copies.py    its maths: the copies, their routers, the ways to break their symmetry (pure)
"""
