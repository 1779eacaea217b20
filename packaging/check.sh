#!/usr/bin/env bash
# Builds the .deb and the .rpm, installs the .deb on this machine, checks what it installed
# (the sample configs with `wanoptd check`, the units with `systemd-analyze verify`), runs the
# sample pair from the installed files as systemd would (as the wanopt user, each with its
# state directory) until its link is up, lists the .rpm, and purges the package again.
# Run as root from the repository root after `cargo build --release --workspace`; CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

if dpkg -s wanopt >/dev/null 2>&1; then
    echo "FAIL: a wanopt package is already installed here; this check installs and purges its own"
    exit 1
fi

rm -rf target/debian target/generate-rpm
# The release profile keeps line tables for profiling; the packages do not need them.
for f in target/release/wanoptd target/release/wanopt-replay target/release/wansim; do
    strip --strip-debug -o "$f.stripped" "$f" && mv "$f.stripped" "$f"
done
cargo deb -p wanoptd --no-build >/dev/null
cargo generate-rpm -p crates/wanoptd >/dev/null
deb=$(ls target/debian/wanopt_*.deb)
rpmfile=$(ls target/generate-rpm/wanopt-*.rpm)
echo "built $deb ($(du -h "$deb" | cut -f1)) and $rpmfile ($(du -h "$rpmfile" | cut -f1))"

purge() { dpkg --purge wanopt >/dev/null 2>&1 || true; }
trap purge EXIT

apt-get install -y -qq "./$deb" >/dev/null
for f in /usr/bin/wanoptd /usr/bin/wanopt-replay /usr/bin/wansim \
    /usr/lib/systemd/system/wanoptd.service /usr/lib/systemd/system/wanoptd@.service \
    /usr/lib/sysusers.d/wanopt.conf /usr/lib/sysctl.d/99-wanopt.conf \
    /etc/wanopt/west.yaml /etc/wanopt/east.yaml /etc/wanopt/certs/ca.pem \
    /usr/share/wanopt/prometheus-rules.yaml /usr/share/doc/wanopt/docs/configuration.md; do
    [ -e "$f" ] || { echo "FAIL: the package did not install $f"; exit 1; }
done
# Each listing is read whole before it is searched: `grep -q` stops at its first match, and under
# pipefail a writer that then meets the closed pipe fails the check.
conffiles=$(dpkg-query -W -f='${Conffiles}\n' wanopt)
grep -q /etc/wanopt/west.yaml <<<"$conffiles" ||
    { echo "FAIL: /etc/wanopt/west.yaml is not a conffile"; exit 1; }
getent passwd wanopt >/dev/null || { echo "FAIL: no wanopt user"; exit 1; }
[ "$(stat -c %U:%a /etc/wanopt/certs/west.key)" = "wanopt:600" ] ||
    { echo "FAIL: west.key is $(stat -c %U:%a /etc/wanopt/certs/west.key)"; exit 1; }

# Every relative link of the installed docs leads to an installed file.
while read -r md; do
    dir=$(dirname "$md")
    for target in $(grep -o '](\([^)#]*\)' "$md" | sed 's/^](//' | grep -v '^https\?:' || true); do
        [ -e "$dir/$target" ] ||
            { echo "FAIL: $md links $target, which the package does not install"; exit 1; }
    done
done < <(find /usr/share/doc/wanopt -name '*.md')

# The sample configs, as the daemon's user reads them.
for site in west east; do
    runuser -u wanopt -- wanoptd check -c "/etc/wanopt/$site.yaml" >/dev/null
done
systemd-analyze verify /usr/lib/systemd/system/wanoptd.service \
    /usr/lib/systemd/system/wanoptd@west.service
# The tuned TCP is in force after the install, not only after the next boot: every setting of
# the drop-in the kernel accepts reads back as it says (whitespace aside).
grep -E '^[a-z]' /usr/lib/sysctl.d/99-wanopt.conf | while IFS='=' read -r key want; do
    key=$(echo "$key" | tr -d ' ')
    want=$(echo "$want" | tr -s ' \t' ' ' | sed 's/^ //; s/ $//')
    got=$(sysctl -n "$key" | tr -s ' \t' ' ' | sed 's/^ //; s/ $//')
    case "$key" in *congestion_control)
        # A list the kernel prints in its own order.
        want=$(echo "$want" | tr ' ' '\n' | sort | tr '\n' ' ' | sed 's/ $//')
        got=$(echo "$got" | tr ' ' '\n' | sort | tr '\n' ' ' | sed 's/ $//') ;;
    esac
    [ "$got" = "$want" ] && continue
    # A value this kernel refuses (fq without sch_fq, say) is the host's to fix, not the
    # package's: it is told. One the kernel takes means the install did not apply the drop-in.
    if sysctl -q -w "$key=$want" >/dev/null 2>&1; then
        echo "FAIL: after install $key is '$got', the drop-in says '$want' (and the kernel takes it)"
        exit 1
    fi
    echo "note: this kernel refuses $key = $want (it stays '$got')"
done
echo "installed: binaries, units (verified), sysusers, sysctl (applied), configs (checked), certificates"

# An upgrade (the same package again) leaves an edited config and the certificates alone.
echo "# edited by the operator" >>/etc/wanopt/west.yaml
ca=$(sha256sum /etc/wanopt/certs/ca.pem)
dpkg -i "$deb" >/dev/null
grep -q "edited by the operator" /etc/wanopt/west.yaml ||
    { echo "FAIL: reinstalling replaced an edited config"; exit 1; }
[ "$(sha256sum /etc/wanopt/certs/ca.pem)" = "$ca" ] ||
    { echo "FAIL: reinstalling replaced the certificates"; exit 1; }
echo "reinstalled: the edited config and the certificates stayed"

# The sample pair, started as the units start it (user wanopt, STATE_DIRECTORY).
state=$(mktemp -d)
chown wanopt "$state"
logs=()
pids=()
for site in east west; do
    mkdir -p "$state/$site" && chown wanopt "$state/$site" && chmod 700 "$state/$site"
    log="$state/$site.log"
    STATE_DIRECTORY="$state/$site" runuser -u wanopt -- \
        /usr/bin/wanoptd -c "/etc/wanopt/$site.yaml" 2>"$log" &
    pids+=($!)
    logs+=("$log")
done
up=0
for _ in $(seq 1 100); do
    if grep -q "link up" "${logs[0]}" && grep -q "link up" "${logs[1]}"; then
        up=1
        break
    fi
    sleep 0.1
done
# Each sample has an admin endpoint: `wanoptd stats -c` works out of the box.
stats=0
if [ "$up" = 1 ]; then
    for site in west east; do
        wanoptd stats -c "/etc/wanopt/$site.yaml" >"$state/$site.stats" || stats=1
    done
fi
# An upgrade of a running pair (the same package again): postinst hands both daemons over to
# the new binary (handover.sh), and the link resumes.
handed=0
if [ "$up" = 1 ]; then
    WANOPT_HANDOVER_WAIT=30 dpkg -i "$deb" >"$state/upgrade.out" 2>&1 || true
    handed=1
    for i in 0 1; do
        grep -q "took the daemon over from the process before" "${logs[$i]}" || handed=0
        kill -0 "${pids[$i]}" 2>/dev/null && handed=0
    done
    if [ "$handed" = 1 ]; then
        resumed=0
        for _ in $(seq 1 100); do
            if grep -q "link resumed" "${logs[0]}" && grep -q "link resumed" "${logs[1]}"; then
                resumed=1
                break
            fi
            sleep 0.1
        done
        [ "$resumed" = 1 ] || handed=0
    fi
fi
kill "${pids[@]}" 2>/dev/null || true
wait "${pids[@]}" 2>/dev/null || true
# The processes the handover started are not our children: found by their binary.
for d in /proc/[0-9]*; do
    [ "$(readlink "$d/exe" 2>/dev/null)" = /usr/bin/wanoptd ] && kill "${d#/proc/}" 2>/dev/null
done
if [ "$up" = 1 ] && [ "$handed" != 1 ]; then
    echo "FAIL: upgrading the package under the running pair did not hand it over"
    cat "$state/upgrade.out" "${logs[@]}"
    exit 1
fi
if [ "$stats" != 0 ]; then
    echo "FAIL: wanoptd stats -c with an installed sample config"
    exit 1
fi
if [ "$up" != 1 ]; then
    echo "FAIL: the installed sample pair did not come up"
    cat "${logs[@]}"
    exit 1
fi
rm -rf "$state"
echo "the installed sample pair came up, and an upgrade under it handed both daemons over"

echo "rpm contents:"
rpm -qlp "$rpmfile"
scripts=$(rpm -qp --scripts "$rpmfile")
grep -q /usr/share/wanopt/setup.sh <<<"$scripts" ||
    { echo "FAIL: the rpm does not run setup.sh after install"; exit 1; }
grep -q /usr/share/wanopt/handover.sh <<<"$scripts" ||
    { echo "FAIL: the rpm does not hand running daemons over on an upgrade"; exit 1; }
configs=$(rpm -qcp "$rpmfile")
grep -q /etc/wanopt/east.yaml <<<"$configs" ||
    { echo "FAIL: /etc/wanopt/east.yaml is not a config file of the rpm"; exit 1; }

dpkg --purge wanopt >/dev/null
[ ! -e /usr/bin/wanoptd ] && [ ! -e /etc/wanopt/certs ] ||
    { echo "FAIL: purge left files behind"; exit 1; }
trap - EXIT
echo "packages: ok"
