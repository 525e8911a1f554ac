"""The engine: model, attention, runner, scheduler, block manager, sequences, sampling (one process, no I/O)."""
