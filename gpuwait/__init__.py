"""gpuwait: admission control for GPUs on one machine, with no daemon."""

__version__ = "0.1.0"
