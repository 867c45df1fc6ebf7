"""metrale: a command-line runner for large language models on NVIDIA GPUs."""

__version__ = "0.1.0"
