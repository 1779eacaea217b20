#!/bin/sh
# Post-install for the wanopt package (.deb postinst and .rpm %post both run it): what
# docs/install.md does by hand. It creates the wanopt user, loads the sysctl drop-in, makes the
# configs readable by the daemon, creates certificates for the sample sites if there are none,
# and reloads systemd. It starts nothing.
set -e

systemd-sysusers /usr/lib/sysusers.d/wanopt.conf >/dev/null 2>&1 || {
    # No systemd-sysusers (a minimal container): the same user by hand.
    getent passwd wanopt >/dev/null ||
        useradd --system --home-dir /var/lib/wanoptd --no-create-home \
            --shell /usr/sbin/nologin --user-group wanopt
}

# The configs and keys: readable by the daemon's group, the keys by the daemon alone.
chown root:wanopt /etc/wanopt
chmod 750 /etc/wanopt
for f in /etc/wanopt/*.yaml; do
    [ -e "$f" ] && chown root:wanopt "$f" && chmod 640 "$f"
done

# Certificates for the sample sites west and east, so the sample pair (wanoptd@east and
# wanoptd@west on this host) runs as shipped. For two hosts, make the sites' certificates
# once on one of them (wanoptd certs) and copy the other site's files over.
if [ ! -e /etc/wanopt/certs ]; then
    /usr/bin/wanoptd certs --out /etc/wanopt/certs west east >/dev/null
    chown root:wanopt /etc/wanopt/certs
    chmod 750 /etc/wanopt/certs
    chown wanopt:wanopt /etc/wanopt/certs/west.key /etc/wanopt/certs/east.key
    chmod 600 /etc/wanopt/certs/west.key /etc/wanopt/certs/east.key
    echo "wanopt: created a CA and certificates for the sample sites in /etc/wanopt/certs" \
        "(ca.key is only needed to add a site: move it off this host)"
fi

# Socket buffer maxima, BBR, fq (the drop-in also applies at every boot). systemd-sysctl is not
# on PATH on Debian 12 (it is in /usr/lib/systemd/), and a host without systemd has sysctl(8).
# A host that refuses (a container's read-only /proc/sys) is told, not failed: the drop-in then
# applies at the next boot.
conf=/usr/lib/sysctl.d/99-wanopt.conf
applied=no
for tool in systemd-sysctl /usr/lib/systemd/systemd-sysctl /lib/systemd/systemd-sysctl; do
    if command -v "$tool" >/dev/null 2>&1; then
        "$tool" "$conf" >/dev/null 2>&1 && applied=yes
        break
    fi
done
if [ "$applied" = no ] && command -v sysctl >/dev/null 2>&1; then
    sysctl -q -p "$conf" >/dev/null 2>&1 && applied=yes
fi
if [ "$applied" = no ]; then
    echo "wanopt: could not apply $conf now (it applies at the next boot); see docs/install.md" >&2
fi

if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
echo "wanopt: edit /etc/wanopt/west.yaml or east.yaml (or copy one to /etc/wanopt/wanoptd.yaml)," \
    "then: systemctl enable --now wanoptd@west (or wanoptd@east, or wanoptd)"
