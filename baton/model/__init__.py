"""The model layer: numerics (weights, attention, linear ops, kernels). The engine above schedules."""
