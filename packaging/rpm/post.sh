/usr/share/wanopt/setup.sh
# An upgrade ($1 is 2 or more): running daemons hand over to the new binary, keeping streams.
if [ "$1" -ge 2 ]; then
    /usr/share/wanopt/handover.sh
fi
