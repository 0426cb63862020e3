"""moeify: carve a dense LLaMA/Mistral/Qwen2 checkpoint into a Mixture-of-Experts checkpoint."""

__version__ = "0.1.0"
