"""Machine probes: one query wrapper per backend (NVML, amdsmi, host, software)."""
