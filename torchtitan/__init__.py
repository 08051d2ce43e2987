"""A PyTorch-native LLM pretraining framework whose runs resume exactly."""

from pathlib import Path

# The checkout the package runs from: bundled data and configs are found relative to it.
REPO_ROOT = Path(__file__).resolve().parents[1]
