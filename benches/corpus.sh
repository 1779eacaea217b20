#!/usr/bin/env bash
# Builds the reduction bench's corpus: first/changed pairs of real data, each made by software
# the project did not write, from Debian's packages only. Every pair is a directory holding
# `first` and `changed`; `cargo bench --bench reduction -- --pairs DIR` measures them all.
#
#   pgbench      PostgreSQL's OLTP benchmark (scale 20), pg_basebackup tars before and after
#                a minute of TPC-B with 4 clients
#   pgtext       a PostgreSQL database of real text rows (every Debian changelog on the host, a
#                row per line), base backups before and after a minute of updates, inserts and
#                deletes
#   innodb       MariaDB's InnoDB files (sysbench's OLTP tables) before and after a minute of
#                sysbench oltp_read_write, each a tar of the stopped server's data directory
#   querylog     MariaDB's general query log half way through that run, and at its end (a log
#                that grew by appending)
#   mariadump    mariadb-dump's SQL of the same tables before and after that run: a logical
#                backup whose edits lie tens of unchanged chunks apart
#   pgdump       pg_dump's plain SQL of a pgbench database (scale 30, fillfactor 90) before and
#                after a minute of TPC-B with 8 clients: a logical backup, rows padded with blanks
#   kernel       two releases of a large source tree: fs/, net/, kernel/, mm/ and include/ of the
#                Linux kernel in Debian's linux-source-6.1, its two newest point releases in this
#                release's own suite, as tars
#
# Usage (as root): benches/corpus.sh DIR [PAIR...]   (default: every pair; a pair that exists is
# kept). Needs: postgresql (a running server: WANOPT_PG_PORT, PGPASSWORD), mariadb-server,
# sysbench, xz-utils, and network access to deb.debian.org for kernel.
# Options by environment: SECONDS_OLTP (default 60), PGBENCH_SCALE (20), TEXT_MIB (48),
# SYSBENCH_ROWS (400000 per table, 4 tables).
set -euo pipefail

dir=${1:?usage: corpus.sh DIR [PAIR...]}
shift
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(pgbench pgdump pgtext innodb kernel)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
oltp=${SECONDS_OLTP:-60}
pgport=${WANOPT_PG_PORT:-5432}
export PGHOST=127.0.0.1 PGPORT=$pgport PGUSER=${PGUSER:-postgres}

say() { printf '%s corpus: %s\n' "$(date +%T)" "$*" >&2; }
have() { [ -s "$dir/$1/first" ] && [ -s "$dir/$1/changed" ]; }

# A base backup of the server as one tar (no WAL: the data files are what changes).
base_backup() {
    local out=$1 tmp
    tmp=$(mktemp -d)
    pg_basebackup -D "$tmp" -Ft -X none -c fast 2>/dev/null
    mv "$tmp/base.tar" "$out"
    rm -rf "$tmp"
}

pair_pgbench() {
    local p=$dir/pgbench scale=${PGBENCH_SCALE:-20}
    mkdir -p "$p"
    psql -q -d postgres -c "DROP DATABASE IF EXISTS wanopt_pgbench" -c "CREATE DATABASE wanopt_pgbench"
    say "pgbench: scale $scale"
    pgbench -i -q -s "$scale" wanopt_pgbench >/dev/null 2>&1
    base_backup "$p/first"
    say "pgbench: $oltp s of TPC-B, 4 clients"
    pgbench -c 4 -T "$oltp" wanopt_pgbench 2>/dev/null | grep -E '^tps' >&2 || true
    base_backup "$p/changed"
    psql -q -d postgres -c "DROP DATABASE wanopt_pgbench"
}

pair_pgdump() {
    local p=$dir/pgdump
    mkdir -p "$p"
    psql -q -d postgres -c "DROP DATABASE IF EXISTS wanopt_pgdump" -c "CREATE DATABASE wanopt_pgdump"
    say "pgdump: pgbench scale 30, fillfactor 90"
    pgbench -i -q -s 30 -F 90 wanopt_pgdump >/dev/null 2>&1
    pg_dump wanopt_pgdump >"$p/first"
    say "pgdump: $oltp s of TPC-B, 8 clients"
    pgbench -c 8 -T "$oltp" wanopt_pgdump 2>/dev/null | grep -E '^tps' >&2 || true
    pg_dump wanopt_pgdump >"$p/changed"
    psql -q -d postgres -c "DROP DATABASE wanopt_pgdump"
}

pair_pgtext() {
    local p=$dir/pgtext limit=$((${TEXT_MIB:-48} << 20)) rows
    mkdir -p "$p"
    say "pgtext: ${TEXT_MIB:-48} MiB of changelog rows"
    # A row per non-empty changelog line: package, line number, text (COPY's text format). The
    # pipe is cut at the limit, so its writers may end on SIGPIPE.
    set +o pipefail
    find /usr/share/doc -name 'changelog*.gz' | sort | while read -r f; do
        pkg=$(basename "$(dirname "$f")")
        zcat "$f" 2>/dev/null | iconv -c -f UTF-8 -t UTF-8 | tr -d '\r\t\\' | awk -v p="$pkg" 'NF { print p "\t" NR "\t" $0 }'
    done | head -c "$limit" | awk -F'\t' 'NF == 3' >"$p/rows.tsv"
    set -o pipefail
    psql -q -d postgres -c "DROP DATABASE IF EXISTS wanopt_text" -c "CREATE DATABASE wanopt_text"
    psql -q -d wanopt_text <<SQL
CREATE TABLE notes (id bigserial primary key, pkg text, line_no int, body text, qty int default 1,
    price numeric(12,2) default 9.99, updated timestamptz default now());
\copy notes(pkg, line_no, body) FROM '$p/rows.tsv'
CREATE INDEX ON notes(pkg);
SQL
    rm -f "$p/rows.tsv"
    base_backup "$p/first"
    rows=$(psql -qtA -d wanopt_text -c "SELECT max(id) FROM notes")
    cat >"$p/oltp.sql" <<SQL
\set id random(1, $rows)
BEGIN;
UPDATE notes SET qty = qty + 1, price = price * 1.01, updated = now() WHERE id = :id;
UPDATE notes SET body = body || ' (rev)' WHERE id = :id + 7;
INSERT INTO notes(pkg, line_no, body) SELECT pkg, line_no + 100000, body FROM notes WHERE id = :id + 13;
DELETE FROM notes WHERE id = :id + 29;
COMMIT;
SQL
    say "pgtext: $oltp s of OLTP, 4 clients"
    pgbench -n -c 4 -T "$oltp" -f "$p/oltp.sql" wanopt_text 2>/dev/null | grep -E '^tps' >&2 || true
    rm -f "$p/oltp.sql"
    base_backup "$p/changed"
    psql -q -d postgres -c "DROP DATABASE wanopt_text"
}

# A private MariaDB in $1 (no network, root's socket).
maria_start() {
    local m=$1
    mariadbd --no-defaults --datadir="$m/data" --socket="$m/sock" --skip-networking \
        --user=root --innodb-buffer-pool-size=512M --innodb-flush-log-at-trx-commit=2 \
        --general-log-file="$m/query.log" --pid-file="$m/pid" >"$m/err.log" 2>&1 &
    for _ in $(seq 150); do
        mariadb --socket="$m/sock" -uroot -e 'SELECT 1' >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    say "mariadbd did not start: $(tail -3 "$m/err.log")"
    return 1
}

maria_stop() {
    local m=$1
    mariadb --socket="$m/sock" -uroot -e 'SHUTDOWN' >/dev/null 2>&1 || true
    for _ in $(seq 300); do
        [ -e "$m/pid" ] || return 0
        sleep 0.2
    done
}

pair_innodb() {
    local p=$dir/innodb q=$dir/querylog l=$dir/mariadump m rows=${SYSBENCH_ROWS:-400000}
    mkdir -p "$p" "$q" "$l"
    m=$(mktemp -d)
    mariadb-install-db --no-defaults --datadir="$m/data" --user=root \
        --auth-root-authentication-method=socket --skip-test-db >/dev/null
    maria_start "$m"
    mariadb --socket="$m/sock" -uroot -e 'CREATE DATABASE sbtest'
    local sb=(sysbench oltp_read_write --db-driver=mysql --mysql-socket="$m/sock"
        --mysql-user=root --mysql-db=sbtest --tables=4 --table-size="$rows" --threads=4)
    say "innodb: sysbench prepare, 4 tables of $rows rows"
    "${sb[@]}" prepare >/dev/null
    mariadb-dump --socket="$m/sock" -uroot --single-transaction sbtest >"$l/first"
    maria_stop "$m"
    tar -C "$m/data" -cf "$p/first" .
    maria_start "$m"
    mariadb --socket="$m/sock" -uroot -e 'SET GLOBAL general_log = 1'
    say "innodb: $oltp s of sysbench oltp_read_write, 4 threads (the query log copied half way)"
    "${sb[@]}" --time="$oltp" run >/dev/null &
    local run=$!
    sleep $((oltp / 2))
    cp "$m/query.log" "$q/first"
    wait "$run"
    mariadb --socket="$m/sock" -uroot -e 'SET GLOBAL general_log = 0'
    cp "$m/query.log" "$q/changed"
    mariadb-dump --socket="$m/sock" -uroot --single-transaction sbtest >"$l/changed"
    maria_stop "$m"
    tar -C "$m/data" -cf "$p/changed" .
    rm -rf "$m"
}

pair_kernel() {
    local p=$dir/kernel a codename versions v
    mkdir -p "$p"
    a=$(mktemp -d)
    codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
    # The two newest point releases of the kernel source in the release's own suite.
    versions=$(apt-cache madison linux-source-6.1 | awk -F' *[|] *' -v s="$codename/main" \
        'index($3, " " s " ") { print $2 }' | sort -uV | tail -2)
    [ "$(wc -l <<<"$versions")" = 2 ] || { say "kernel: fewer than two linux-source-6.1 releases in $codename"; return 1; }
    local which=first
    for v in $versions; do
        say "kernel: linux-source-6.1 $v"
        (cd "$a" && apt-get download -q "linux-source-6.1=$v" >/dev/null 2>&1)
        mkdir -p "$a/$v"
        dpkg-deb --fsys-tarfile "$a"/linux-source-6.1_"${v/:/%3a}"_all.deb |
            tar -xO --wildcards '*/linux-source-6.1.tar.xz' | xz -dc |
            tar -x -C "$a/$v" --wildcards 'linux-source-6.1/fs' 'linux-source-6.1/net' \
                'linux-source-6.1/kernel' 'linux-source-6.1/mm' 'linux-source-6.1/include'
        # The trees as one tar, in a stable order: what a build farm or a mirror would copy.
        tar -C "$a/$v" --sort=name --mtime=@0 --owner=0 --group=0 -cf "$p/$which" linux-source-6.1
        rm -rf "${a:?}/$v" "$a"/*.deb
        which=changed
    done
    rm -rf "$a"
}

for name in "${pairs[@]}"; do
    case $name in
    querylog | mariadump) name=innodb ;;
    esac
    if have "$name" && { [ "$name" != innodb ] || { have querylog && have mariadump; }; }; then
        say "$name: kept"
        continue
    fi
    "pair_$name"
done
for p in "$dir"/*/; do
    [ -s "$p/first" ] || continue
    printf '%-10s first %5d MB  changed %5d MB\n' "$(basename "$p")" \
        $(($(stat -c %s "$p/first") / 1000000)) $(($(stat -c %s "$p/changed") / 1000000))
done
