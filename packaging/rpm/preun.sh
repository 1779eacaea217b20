# On removal (not upgrade: $1 is 0), stop the daemons before their binary goes.
if [ "$1" = 0 ] && [ -d /run/systemd/system ]; then
    systemctl stop 'wanoptd.service' 'wanoptd@*.service' >/dev/null 2>&1 || true
fi
