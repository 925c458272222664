"""Reading GPUs: the backend protocol, NVML, and the simulation with its simulated jobs."""
