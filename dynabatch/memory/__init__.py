"""What a batch costs: measuring peak memory, model shape and features, the spike classifier, the memory model."""

TASKS = ("generate", "forward", "train")
"""What a calibration's work runs (``dynabatch calibrate --task``), as a memory model's metadata records it: here,
not in :mod:`dynabatch.memory.model`, so the command line names them without importing torch."""
