"""Benchmark helpers behind `scripts/bench_*.py`: the report writer and the one disk probe
(`reporting`), kernel timing and synthetic expert pools (`kernels`), the server load generator
(`server`) and the transformers side-by-side run (`side_by_side`)."""
