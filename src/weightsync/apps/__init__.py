"""The applications: the end-to-end demo, the doctor, the benchmarks."""
