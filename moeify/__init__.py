"""moeify: carve a dense LLaMA/Mistral checkpoint into a Mixture-of-Experts checkpoint."""

__version__ = "0.1.0"
