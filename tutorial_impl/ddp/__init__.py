"""DDP in practice, and what came after it (a course: see docs/ddp.md)."""
