"""Training engine: config, schedule, loop, checkpoint, metrics, distributed."""
