"""What a batch costs: measuring peak memory, model shape and features, the spike classifier, the memory model."""
