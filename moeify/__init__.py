"""moeify: carve a dense Llama/Mistral/Qwen2/Qwen3 checkpoint into a Mixture-of-Experts checkpoint, and measure what
that costs. From Python (moeify.api; torch loads on first use, not on import):

    import moeify
    moeify.convert("Qwen/Qwen2.5-0.5B", "out/qwen-moe", preset="active-50", tune=False)
"""

from .version import __version__

_API = ("convert", "upcycle", "merge", "tune", "train", "evaluate", "plan", "Conversion", "MoeifyError")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'moeify' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])


__all__ = ["__version__", *_API]
