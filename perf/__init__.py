"""graphspec benchmarks (pytest-benchmark suites, the CPU step probe, the one-call GPU check); not installed."""
