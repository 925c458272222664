"""The operating system: /proc, signals, locks, state files, who may do what (Linux only)."""
