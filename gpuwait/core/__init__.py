"""The pure core: decisions and formats over plain values (no I/O, no clock, no processes)."""
