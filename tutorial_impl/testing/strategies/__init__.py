"""The ways to start ranks, behind one protocol: forked, warm worlds, torchrun."""
