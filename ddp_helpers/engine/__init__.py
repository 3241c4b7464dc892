"""The training engine: settings, the per-rank loop, telemetry, checkpoints, and run_training that ties them up."""
