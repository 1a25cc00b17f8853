"""Inference: the dynamic-batch DataLoader and ``run()`` (input order, out-of-memory recovery, resume, report)."""
