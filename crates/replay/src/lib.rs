//! `wanopt-replay`: the bundled benchmark and replay tool. An oratcptest-compatible client and
//! server (its command lines and output, with latency percentiles and JSON added), a recording
//! proxy and a replayer that keeps each session's causality, and deterministic synthetic
//! database workloads (`gen`), and `compare` to run one workload over several paths. Blocking sockets and one thread per
//! connection keep the timing simple and the code easy to follow.

pub mod args;
pub mod chart;
pub mod client;
pub mod compare;
pub mod progress;
pub mod proto;
pub mod record;
pub mod replay;
pub mod server;
pub mod showcase;
pub mod stats;
pub mod trace;
pub mod workload;
