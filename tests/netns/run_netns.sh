#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by a veth pair, two
# ranks in each, rendezvous over the veth addresses (MASTER_ADDR is host A's
# veth address, no GLOO_SOCKET_IFNAME: Gloo must find the address that
# reaches it), and the mesh4 suite, whose meshes have groups that cross the
# two hosts. Exits 77 (CTest: skipped) with the reason where namespaces cannot
# be made (not root, no CAP_SYS_ADMIN, no iproute2).
#
#     run_netns.sh ACCEL_TESTS
set -uo pipefail
tests=$1
skip() { echo "SKIPPED: network namespaces unavailable here: $*"; exit 77; }
command -v ip >/dev/null || skip "no 'ip' command (Debian: iproute2)"
id=$$
a=accel_a_$id b=accel_b_$id
ip netns add "$a" 2>/dev/null || skip "'ip netns add' failed (needs root or CAP_SYS_ADMIN)"
cleanup() {
  ip netns pids "$a" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns pids "$b" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns del "$a" 2>/dev/null
  ip netns del "$b" 2>/dev/null
}
trap cleanup EXIT
ip netns add "$b" || skip "'ip netns add' failed for the second namespace"
net=10.$((200 + id % 50)).$((id / 50 % 250))
ip link add "va$id" type veth peer name "vb$id" || skip "cannot create a veth pair"
ip link set "va$id" netns "$a" && ip link set "vb$id" netns "$b" || exit 1
ip -n "$a" addr add "$net.1/24" dev "va$id" && ip -n "$b" addr add "$net.2/24" dev "vb$id" || exit 1
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "va$id" up && ip -n "$b" link set "vb$id" up || exit 1

echo "host A: namespace $a, $net.1 (ranks 0, 1); host B: namespace $b, $net.2 (ranks 2, 3)"
pids=()
for rank in 0 1 2 3; do
  ns=$a
  ((rank >= 2)) && ns=$b
  ip netns exec "$ns" env -u ACCEL_STORE_DIR -u GLOO_SOCKET_IFNAME RANK=$rank WORLD_SIZE=4 LOCAL_RANK=$((rank % 2)) \
    LOCAL_WORLD_SIZE=2 MASTER_ADDR=$net.1 MASTER_PORT=29500 \
    timeout 150 "$tests" -ts=mesh4 --abort-after=1 --no-intro=true 2>&1 | sed "s/^/[rank $rank] /" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done  # pipefail: the test's status, not sed's
exit $status
