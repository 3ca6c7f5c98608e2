#!/bin/sh
# Uplink SRPT in a scratch namespace: install, inspect and remove the priority qdisc with the CLI.
# Needs root (ip netns, tc). Everything is created fresh and deleted at the end.
#
#   sh examples/uplink/demo.sh
#
# On a real server: `overtake uplink install --dev eth0 --rate 100mbit`, then run the sidecar
# with `--uplink srpt` (or srrt); it detects the bands and logs which are in use.
set -eu
OVERTAKE=${OVERTAKE:-overtake}
NS=ovt_demo_$$
trap 'ip netns del $NS 2>/dev/null || true' EXIT
ip netns add $NS
ip -n $NS link add up0 type veth peer name up1
ip -n $NS link set up0 up
ip -n $NS link set up1 up

echo '$ overtake uplink install --dev up0 --dry-run --mode tbf'
$OVERTAKE uplink install --dev up0 --netns $NS --dry-run --mode tbf
echo '$ overtake uplink install --dev up0 --rate 10mbit'
$OVERTAKE uplink install --dev up0 --netns $NS --rate 10mbit | tail -1
echo '$ overtake uplink install --dev up0 --rate 10mbit   # again: nothing changes'
$OVERTAKE uplink install --dev up0 --netns $NS --rate 10mbit
echo '$ overtake uplink show --dev up0'
$OVERTAKE uplink show --dev up0 --netns $NS
echo '$ overtake uplink remove --dev up0'
$OVERTAKE uplink remove --dev up0 --netns $NS
$OVERTAKE uplink remove --dev up0 --netns $NS
