"""moeify's version (in its own module: the package's __init__ exposes the Python API)."""

__version__ = "0.1.0"
