#!/usr/bin/env bash
# Runs the commands README.md and docs/install.md give a reader, as written, line by line as a
# reader types them, on this machine: root on Debian 12, as CI has it. Run from the repository
# root after `cargo build --release --workspace` and packaging/check.sh (which covers the
# package path: install, configs, units, the sample pair, purge); CI runs it.
#
# - README, Quick start: `cargo run ... demo`, then the web server and curl through the pair.
# - README, two gateway hosts: certs, check and both daemons (on one host, with the shipped
#   configs copied to /etc/wanopt first, as the paragraph before it says).
# - docs/install.md, From a package: build, install, start the sample units (and the README's
#   install block), then purge.
# - docs/install.md, By hand: every line.
# This machine has no systemd as PID 1, so `systemctl` and `journalctl` are the functions
# written to systemd.sh below: they verify the unit with systemd-analyze and run its ExecStart
# as its User with its StateDirectory, as systemd would; everything else runs as the reader
# would run it.
# - README: the showcase (as root, about two minutes).
# The README's test command is CI's own; the replication recipes are tests/recipes.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
export PATH="$repo/target/release:$PATH"

fail() { echo "FAIL: $*"; exit 1; }
work=$(mktemp -d)
jobs_to_kill=()
# What the package and the by-hand block install, removed again (also when a step fails).
remove_installed() {
    dpkg --purge wanopt >/dev/null 2>&1 || true
    for p in /tmp/recipes-*.pid; do [ -e "$p" ] && kill "$(cat "$p")" 2>/dev/null; done
    rm -f /usr/bin/wanoptd /usr/bin/wanopt-replay /usr/bin/wansim /etc/sysusers.d/wanopt.conf \
        /etc/sysctl.d/99-wanopt.conf /etc/systemd/system/wanoptd.service \
        /etc/systemd/system/wanoptd@.service /tmp/recipes-*
    rm -rf /etc/wanopt /var/lib/wanoptd
    userdel wanopt 2>/dev/null || true
}
cleanup() {
    for p in "${jobs_to_kill[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    remove_installed
    rm -rf "$work" "$repo/config/certs" "$repo/config/state"
}
trap cleanup EXIT

# The N-th ```sh block of the section whose heading line is HEADING in FILE.
block() {
    awk -v h="$2" -v n="$3" '
        $0 == h { in_section = 1; next }
        in_section && /^## / { exit }
        in_section && $0 == "```sh" { k++; if (k == n) { grab = 1 }; next }
        grab && $0 == "```" { exit }
        grab { print }
    ' "$1"
}

# Runs LINES one at a time in one shell, as typed; a line ending in `&` gets a second to start.
type_lines() {
    local script=""
    while IFS= read -r line; do
        script+="$line"$'\n'
        local code=${line%%#*}
        code=${code%"${code##*[![:space:]]}"}
        case "$code" in *"&") script+="sleep 1"$'\n' ;; esac
    done <<<"$1"
    bash -euo pipefail -c "$script"
}

# Waits until FILE has N lines containing TEXT.
wait_lines() {
    local file=$1 text=$2 n=$3
    for _ in $(seq 1 300); do
        [ "$(grep -c "$text" "$file" 2>/dev/null || true)" -ge "$n" ] && return 0
        sleep 0.1
    done
    cat "$file"
    fail "$file: fewer than $n lines with '$text'"
}

cat >"$work/systemd.sh" <<'EOF'
# systemctl and journalctl for a machine without systemd as PID 1 (see the top of this file).
unit_file() {
    local name="${1%%@*}$([[ $1 == *@* ]] && echo @).service" d
    for d in /etc/systemd/system /usr/lib/systemd/system; do
        [ -e "$d/$name" ] && { echo "$d/$name"; return; }
    done
    echo "systemctl: no unit $1" >&2
    return 1
}
systemctl() {
    local unit file cmd user state log
    case "$1" in
    daemon-reload)
        for file in /etc/systemd/system/wanoptd*.service; do
            [ -e "$file" ] || continue
            case "$file" in
            *@.service) systemd-analyze verify "${file%@.service}@check.service" >/dev/null ;;
            *) systemd-analyze verify "$file" >/dev/null ;;
            esac
        done ;;
    enable)
        [ "$2" = --now ] || return 1
        shift 2
        for unit in "$@"; do
            file=$(unit_file "$unit")
            user=$(sed -n 's/^User=//p' "$file")
            state=/var/lib/$(sed -n 's/^StateDirectory=//p' "$file" | sed "s/%i/${unit#*@}/")
            cmd=$(sed -n 's/^ExecStart=//p' "$file" | sed "s/%i/${unit#*@}/")
            install -d -m 700 -o "$user" "$state"
            log=/tmp/recipes-$unit.log
            STATE_DIRECTORY=$state setsid runuser -u "$user" -- $cmd 2>"$log" &
            echo $! >"/tmp/recipes-$unit.pid"
        done ;;
    status)
        unit=$2
        log=/tmp/recipes-$unit.log
        for _ in $(seq 1 100); do grep -q '"service"' "$log" 2>/dev/null && break; sleep 0.1; done
        kill -0 "$(cat "/tmp/recipes-$unit.pid")" 2>/dev/null || { cat "$log"; return 3; }
        echo "$unit: running"
        tail -n 5 "$log" ;;
    *) echo "systemctl $*: not emulated here" >&2; return 1 ;;
    esac
}
journalctl() { [ "$1" = -u ] && cat "/tmp/recipes-$2.log"; }
stop_units() {
    local p
    for p in /tmp/recipes-*.pid; do
        [ -e "$p" ] && { kill "$(cat "$p")" 2>/dev/null || true; rm -f "$p"; }
    done
    return 0
}
EOF

echo "== README: Quick start"
demo=$(block README.md "## Quick start" 1)
[ "$demo" = "cargo run --release -p wanoptd -- demo" ] || fail "the quick start's first block changed: $demo"
setsid bash -c "$demo" 2>"$work/demo.log" &
demo_pid=$!
jobs_to_kill+=("$demo_pid")
wait_lines "$work/demo.log" "link up" 2
try=$(block README.md "## Quick start" 2)
grep -q "curl" <<<"$try" || fail "the quick start's second block has no curl"
(cd "$work" && type_lines "$try" >"$work/curl.out"; echo $? >"$work/curl.rc") || true
pkill -f "http.server 8000" 2>/dev/null || true
[ "$(cat "$work/curl.rc")" = 0 ] || fail "the quick start's curl through the demo pair failed"
grep -q "Directory listing" "$work/curl.out" || fail "curl did not fetch the page: $(head -c 300 "$work/curl.out")"
kill -INT -- "-$demo_pid" 2>/dev/null || kill -INT "$demo_pid"
wait "$demo_pid" 2>/dev/null || true
grep -q "site{site=west}.*service totals service=http raw_out=[1-9]" "$work/demo.log" ||
    fail "the demo's totals do not show the page at west: $(grep totals "$work/demo.log")"
echo "quick start: the demo came up and a page crossed it"

echo "== README: the showcase"
show=$(block README.md "## Quick start" 3)
grep -q "showcase" <<<"$show" || fail "the quick start's third block has no showcase"
(cd "$repo" && type_lines "$show" >"$work/showcase.out" 2>&1) ||
    { tail -30 "$work/showcase.out"; fail "the README's showcase command failed"; }
[ -s showcase.svg ] || fail "the showcase wrote no chart"
rm -f showcase.svg
echo "showcase: ran across its emulated WAN and drew its chart"

echo "== README: two gateway hosts (both on this host)"
two=$(block README.md "## Quick start" 4)
grep -q "wanoptd certs" <<<"$two" || fail "the two-hosts block changed: $two"
rm -rf /etc/wanopt && install -d /etc/wanopt && cp config/west.yaml config/east.yaml /etc/wanopt/
setup=$(grep -v '^wanoptd -c' <<<"$two")
type_lines "$setup" >"$work/two.out"
grep -q "site: east" "$work/two.out" || fail "wanoptd check printed no effective config"
state=$(mktemp -d)
while read -r line; do
    cmd=${line%%#*}
    site=$(grep -o '/etc/wanopt/[a-z]*' <<<"$cmd" | xargs basename)
    # One host plays both: each daemon gets the state directory its own host would have.
    STATE_DIRECTORY="$state/$site" setsid bash -c "$cmd" 2>"$work/$site.log" &
    jobs_to_kill+=("$!")
done < <(grep '^wanoptd -c' <<<"$two")
wait_lines "$work/east.log" "link up" 1
wait_lines "$work/west.log" "link up" 1
for p in "${jobs_to_kill[@]}"; do kill "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
jobs_to_kill=()
rm -rf /etc/wanopt "$state"
echo "two hosts: certificates made, east checked, the pair came up"

echo "== docs/install.md: From a package (and the README's install block)"
dpkg -s wanopt >/dev/null 2>&1 && fail "a wanopt package is installed already"
type_lines "$(block docs/install.md "## From a package" 1)" >/dev/null
type_lines "$(block docs/install.md "## From a package" 2)" >/dev/null
type_lines "source $work/systemd.sh"$'\n'"$(block docs/install.md "## From a package" 3)" >"$work/pkg.out" ||
    { cat "$work/pkg.out" /tmp/recipes-*.log; fail "the packaged unit did not start"; }
grep -q "wanoptd@west: running" "$work/pkg.out" || fail "wanoptd@west is not running"
# The other half of the sample pair, as the paragraph before says, and the link comes up.
bash -c "source $work/systemd.sh; systemctl enable --now wanoptd@east"
wait_lines /tmp/recipes-wanoptd@west.log "link up" 1
wanoptd stats -c /etc/wanopt/west.yaml >/dev/null || fail "wanoptd stats -c /etc/wanopt/west.yaml"
bash -c "source $work/systemd.sh; stop_units"
sleep 1
# The README's install block: the same package again, and its unit.
type_lines "source $work/systemd.sh"$'\n'"$(block README.md "## Install on a gateway host" 1)" >/dev/null
bash -c "source $work/systemd.sh; systemctl status wanoptd@west" >/dev/null ||
    fail "the README's install block did not start wanoptd@west"
bash -c "source $work/systemd.sh; stop_units"
sleep 1
dpkg --purge wanopt >/dev/null
[ ! -e /etc/wanopt/certs ] || fail "purge left the certificates"
userdel wanopt
rm -rf /var/lib/wanoptd /tmp/recipes-*
echo "from a package: built, installed, the sample pair came up, purged"

echo "== docs/install.md: By hand"
remove_installed
units_before=$(ls /etc/systemd/system)
hand=$(block docs/install.md "## By hand" 1)
grep -q "systemctl enable --now wanoptd" <<<"$hand" || fail "the by-hand block changed"
type_lines "source $work/systemd.sh"$'\n'"$hand" >"$work/hand.out" || {
    cat "$work/hand.out" /tmp/recipes-wanoptd.log 2>/dev/null
    fail "the by-hand install failed"
}
grep -q "wanoptd: running" "$work/hand.out" || fail "the by-hand unit is not running"
grep -q 'bound kind="service" service=dg' /tmp/recipes-wanoptd.log ||
    fail "the by-hand daemon did not bind its services: $(cat /tmp/recipes-wanoptd.log)"
[ "$(stat -c %U /var/lib/wanoptd)" = wanopt ] || fail "the state directory is not the daemon's"
remove_installed
sleep 1
[ "$(ls /etc/systemd/system)" = "$units_before" ] || fail "units left behind"
echo "by hand: installed, checked, the unit's daemon ran as wanopt and bound its services"
echo "recipes: ok"
