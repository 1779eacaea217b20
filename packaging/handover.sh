#!/bin/sh
# After an upgrade put a new /usr/bin/wanoptd in place (the .deb's postinst and the .rpm's %post
# run this): hand every running wanoptd over to it (SIGUSR2, docs/upgrades.md), so no stream
# drops. A daemon that cannot hand over is restarted by its unit (its streams reset), and says
# so; one from a version before handovers (it does not catch SIGUSR2, which would kill it) is
# restarted by its unit too, or, without systemd, left running the old binary with a note.
# WANOPT_HANDOVER_WAIT: seconds to wait for each daemon (default 60).
set -u
wait_s=${WANOPT_HANDOVER_WAIT:-60}

# The daemons: the units' main processes under systemd, else every process running
# /usr/bin/wanoptd (a container, or daemons started by hand).
list() {
    if [ -d /run/systemd/system ]; then
        systemctl list-units --type=service --state=running --plain --no-legend \
            'wanoptd.service' 'wanoptd@*.service' 2>/dev/null | while read -r unit _; do
            pid=$(systemctl show -p MainPID --value "$unit" 2>/dev/null)
            [ "${pid:-0}" -gt 0 ] 2>/dev/null && echo "$pid $unit"
        done
    else
        for d in /proc/[0-9]*; do
            exe=$(readlink "$d/exe" 2>/dev/null) || continue
            case "$exe" in
            /usr/bin/wanoptd | "/usr/bin/wanoptd (deleted)") echo "${d#/proc/} -" ;;
            esac
        done
    fi
}

# Whether process $1 catches SIGUSR2 (bit 12 of SigCgt): this version's daemons do.
catches_usr2() {
    mask=$(awk '/^SigCgt:/ { print $2 }' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$mask" ] && [ $(( 0x$mask & 0x800 )) -ne 0 ]
}

restart() { # pid unit why
    if [ "$2" != - ]; then
        echo "wanopt: $2 (pid $1) $3; restarting it: its streams are reset" >&2
        systemctl restart "$2" || echo "wanopt: systemctl restart $2 failed" >&2
    else
        echo "wanopt: wanoptd pid $1 $3; it keeps running the old binary: restart it when its streams allow" >&2
    fi
}

# Listed before the first signal, so the new processes are not signalled in turn.
daemons=$(list)
[ -n "$daemons" ] || exit 0
echo "$daemons" | while read -r pid unit; do
    if ! catches_usr2 "$pid"; then
        restart "$pid" "$unit" "is a version that cannot hand over"
        continue
    fi
    kill -USR2 "$pid" 2>/dev/null || continue
    # It exits once the new process took over; one that refused (the new binary rejects its
    # config, its peer cannot resume) serves on.
    i=0
    while kill -0 "$pid" 2>/dev/null && [ "$i" -lt $((wait_s * 10)) ]; do
        sleep 0.1
        i=$((i + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        restart "$pid" "$unit" "did not hand over within ${wait_s}s (its log says why)"
    else
        echo "wanopt: wanoptd pid $pid${unit#-} handed over to the new binary; its streams go on"
    fi
done
exit 0
