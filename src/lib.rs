//! Home of the end-to-end tests (`tests/`) and benchmarks (`benches/`) of the wanopt binaries.
