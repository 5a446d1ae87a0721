"""PyTorch's distributed tutorials, implemented, plus a pytest harness for multi-rank tests."""
