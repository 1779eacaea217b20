//! PostgreSQL streaming replication through the real daemons: a primary's WAL, written by
//! `pgbench` (its TPC-B-like load, then the order-entry one), reaches `pg_receivewal` on the other
//! side byte for byte (every complete segment is compared with the server's own file), and the
//! tunnel compresses it. Needs a PostgreSQL server (`WANOPT_PG_PORT`, `PGPASSWORD`), as
//! `.ci/run` provides.

mod common;

use common::pg::{self, WalLoad, Workload};
use common::*;

#[test]
fn postgres_wal_streams_exactly_and_compressed() {
    let Some(port) = pg::port() else { return };
    let pair = Pair::start_with_admin(
        &format!("  - name: pg\n    target: 127.0.0.1:{port}\n"),
        "  - name: pg\n    listen: 127.0.0.1:0\n",
    );
    for workload in [Workload::Tpcb, Workload::Orders] {
        let run = pg::stream_wal(
            &pair,
            port,
            &WalLoad {
                workload,
                scale: 2,
                clients: 2,
                seconds: 8,
                ssl: false,
                db: "wanopt_test_wal",
            },
        )
        .unwrap_or_else(|e| panic!("WAL streaming, {}: {e}", workload.name()));
        eprintln!("{}: {run:?}", workload.name());
        assert!(run.segments >= 1, "no complete segment: {run:?}");
        assert!(run.raw > 1 << 20, "too little WAL streamed: {run:?}");
        // WAL records carry row images and zero-filled pages: LZ4 alone leaves well under half of
        // pgbench's, and under two thirds of the orders'.
        match workload {
            Workload::Tpcb => assert!(run.wire * 2 < run.raw, "WAL was not compressed: {run:?}"),
            Workload::Orders => assert!(
                run.wire * 3 < run.raw * 2,
                "WAL was not compressed: {run:?}"
            ),
        }
    }
}
