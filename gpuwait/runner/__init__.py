"""Running one command as a job: starting it, supervising it, and its side of pausing."""
