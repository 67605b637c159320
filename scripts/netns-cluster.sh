#!/usr/bin/env bash
# A cluster of N hosts on this machine: network namespaces, a switch, addresses, an sshd each.
#
#   bash scripts/netns-cluster.sh up 2              # hosts h1, h2 (prefix tdc, 10.213.1.0/24)
#   bash scripts/netns-cluster.sh up 4 --prefix tdx7 --subnet 10.213.7
#   bash scripts/netns-cluster.sh up 2 --debian-hosts  # each host's own name is 127.0.1.1 there
#   bash scripts/netns-cluster.sh exec h1 -- tandem run -np 4 -H h1:2,h2:2 train.py
#   bash scripts/netns-cluster.sh shape h2 --delay-ms 100 --loss 5 --rate-mbit 1000
#   bash scripts/netns-cluster.sh shape h2          # no options: h2's link as it was
#   bash scripts/netns-cluster.sh down [--prefix tdx7]
#
# What `up` builds (root, iproute2 and openssh-server needed; exit 1 and the reason otherwise):
#   - a switch: the namespace <prefix>sw holding a bridge; it has no address and no route, so
#     nothing on it can reach (or be reached from) anything outside the cluster;
#   - host i (1..N): the namespace <prefix>h<i>, its `eth0` (one end of a veth pair whose other
#     end is on the bridge) holding <subnet>.<i>/24, loopback up, IPv6 off (Gloo would pick the
#     link-local address otherwise);
#   - /etc/netns/<prefix>h<i>/: what `ip netns exec` mounts over /etc in that host: `hosts`
#     (h1..hN and their addresses, as a cluster's DNS would say; with --debian-hosts a host's
#     own name is 127.0.1.1, as Debian's installer writes it, the classic trap of multi-host
#     jobs) and `ssh/` (the host's key, an sshd_config, an ssh_config with the cluster's
#     client key and known_hosts, so `ssh h2` works from any host without a prompt);
#   - an sshd per host, started in its namespace under its own hostname (a UTS namespace whose
#     hostname is h<i>), so `hostname`, `socket.gethostname()` and sessions say h<i>.
# State (keys, logs, pid files, one line per host in `hosts`) lives in /tmp/tandem-netns-<prefix>.
#
# `exec HOST -- CMD...` runs CMD on a host (its network, hostname and /etc), in the current
# directory. `shape HOST` shapes what the host sends on its eth0 (replacing earlier shaping):
# --rate-mbit with a tbf qdisc, --loss (percent) with an iptables rule that drops packets at
# random (`-m statistic`), --delay-ms with scripts/netem.py holding each packet in an NFQUEUE
# (the kernels here have no sch_netem, nor nftables' queue; needs iptables: apt-get install
# iptables). TCP hands the host's hooks whole GSO super-packets, so a lost "packet" may be
# several segments. `down` kills every process in the cluster's namespaces (by pid) and removes the
# namespaces, the /etc/netns entries and the state. `up` on a prefix in use tears it down first.
# Every address is inside the namespaces created here: no traffic leaves the cluster.
set -euo pipefail

PREFIX=tdc
SUBNET=10.213.1
DEBIAN_HOSTS=
DELAY_MS= LOSS= RATE_MBIT=
fail() { echo "netns-cluster: $*" >&2; exit 1; }

action=${1:-}
[ $# -gt 0 ] && shift
count=
if [ "$action" = up ]; then
  count=${1:-}
  [[ "$count" =~ ^[0-9]+$ ]] && [ "$count" -ge 1 ] && [ "$count" -le 64 ] \
    || fail "up needs a host count from 1 to 64 (got '${count}')"
  shift
fi
host=
if [ "$action" = exec ] || [ "$action" = shape ]; then
  host=${1:-}
  [ -n "$host" ] || fail "exec needs a host: exec h1 -- command..."
  shift
fi
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) PREFIX=$2; shift 2 ;;
    --subnet) SUBNET=$2; shift 2 ;;
    --debian-hosts) DEBIAN_HOSTS=1; shift ;;
    --delay-ms) DELAY_MS=$2; shift 2 ;;
    --loss) LOSS=$2; shift 2 ;;
    --rate-mbit) RATE_MBIT=$2; shift 2 ;;
    --) shift; break ;;
    *) fail "unknown argument '$1' (see the comment at the top of $0)" ;;
  esac
done
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || fail "--prefix '$PREFIX': 1-8 lowercase letters/digits, a letter first"
[[ "$SUBNET" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || fail "--subnet '$SUBNET': give three octets of a 10.x.y range"
STATE=/tmp/tandem-netns-$PREFIX

namespaces() {  # this cluster's namespaces, hosts first
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}(h[0-9]+|sw)$" || true
}

down() {
  local ns pid
  for ns in $(namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
  done
  for ns in $(namespaces); do
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rm -rf "$STATE"
}

host_namespace() {  # the namespace of host $1, or fail
  [ -f "$STATE/hosts" ] || fail "no cluster with prefix $PREFIX (run: $0 up N --prefix $PREFIX)"
  local line
  line=$(awk -v h="$1" '$1 == h' "$STATE/hosts")
  [ -n "$line" ] || fail "no host $1 in the cluster $PREFIX: $(awk '{printf "%s ", $1}' "$STATE/hosts")"
  echo "$line" | awk '{print $2}'
}

unshape() {  # $1: host, $2: its namespace
  local pidfile="$STATE/netem-$1.pid"
  if command -v iptables >/dev/null; then
    ip netns exec "$2" iptables -D OUTPUT -o eth0 -j TANDEM_SHAPE 2>/dev/null || true
    ip netns exec "$2" iptables -F TANDEM_SHAPE 2>/dev/null || true
    ip netns exec "$2" iptables -X TANDEM_SHAPE 2>/dev/null || true
  fi
  if [ -f "$pidfile" ]; then kill -KILL "$(cat "$pidfile")" 2>/dev/null || true; rm -f "$pidfile"; fi
  ip netns exec "$2" tc qdisc del dev eth0 root 2>/dev/null || true
}

shape() {  # $1: host, $2: its namespace; the options say how
  local host=$1 ns=$2 burst
  unshape "$host" "$ns"
  if [ -n "$RATE_MBIT" ]; then
    [[ "$RATE_MBIT" =~ ^[0-9]+$ ]] || fail "--rate-mbit '$RATE_MBIT': give a whole number of Mbit/s"
    burst=$(( RATE_MBIT * 125 ))  # bytes in 1 ms
    [ "$burst" -ge 131072 ] || burst=131072  # at least two GSO super-packets
    ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "${RATE_MBIT}mbit" \
      burst "$burst" latency 50ms 2>"$STATE/ip.err" || fail "tbf on $host: $(cat "$STATE/ip.err")"
  fi
  [ -n "$LOSS$DELAY_MS" ] || return 0
  command -v iptables >/dev/null || fail "--loss and --delay-ms need iptables: apt-get install iptables"
  ipt() { ip netns exec "$ns" iptables "$@" 2>"$STATE/ip.err" || fail "iptables $* on $host: $(cat "$STATE/ip.err")"; }
  ipt -N TANDEM_SHAPE
  if [ -n "$LOSS" ]; then
    [[ "$LOSS" =~ ^[0-9]+(\.[0-9]+)?$ ]] || fail "--loss '$LOSS': give a percentage"
    ipt -A TANDEM_SHAPE -m statistic --mode random --probability \
      "$(awk -v p="$LOSS" 'BEGIN {printf "%.4f", p / 100}')" -j DROP
  fi
  if [ -n "$DELAY_MS" ]; then
    [[ "$DELAY_MS" =~ ^[0-9]+(\.[0-9]+)?$ ]] || fail "--delay-ms '$DELAY_MS': give milliseconds"
    : > "$STATE/netem-$host.log"
    ip netns exec "$ns" python3 "$(dirname "$0")/netem.py" --queue 0 --delay-ms "$DELAY_MS" \
      >"$STATE/netem-$host.log" 2>&1 &
    echo $! > "$STATE/netem-$host.pid"
    for _ in $(seq 100); do grep -q ready "$STATE/netem-$host.log" && break; sleep 0.05; done
    grep -q ready "$STATE/netem-$host.log" || fail "netem.py did not start on $host: $(cat "$STATE/netem-$host.log")"
    ipt -A TANDEM_SHAPE -j NFQUEUE --queue-num 0 --queue-bypass
  fi
  ipt -A OUTPUT -o eth0 -j TANDEM_SHAPE
}

case $action in
  down) down; exit 0 ;;
  exec)
    ns=$(host_namespace "$host") || exit 1
    [ $# -gt 0 ] || fail "exec $host: no command given"
    exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && cd "$1" && shift && exec "$@"' \
      "$host" "$PWD" "$@" ;;
  shape) ns=$(host_namespace "$host") || exit 1; shape "$host" "$ns"; exit 0 ;;
  up) ;;
  *) fail "usage: $0 up N [--prefix P] [--subnet 10.X.Y] [--debian-hosts] | exec HOST -- CMD... | shape HOST [--delay-ms D] [--loss PCT] [--rate-mbit R] | down [--prefix P]" ;;
esac

# -- up ------------------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces, sshd)"
command -v ip >/dev/null || fail "needs iproute2 (ip)"
command -v unshare >/dev/null || fail "needs unshare (util-linux)"
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
[ -x "$SSHD" ] && command -v ssh-keygen >/dev/null && command -v ssh >/dev/null \
  || fail "needs openssh-server and openssh-client (apt-get install openssh-server; scripts/setup.sh does it as root)"
down  # a cluster of this prefix left by a killed run
trap 'status=$?; [ $status -eq 0 ] || down; exit $status' EXIT

mkdir -p "$STATE" /run/sshd
chmod 700 "$STATE"
ssh-keygen -q -t ed25519 -N '' -C "tandem-netns-$PREFIX" -f "$STATE/id_ed25519" \
  || fail "ssh-keygen failed"
cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
: > "$STATE/known_hosts"
: > "$STATE/hosts"

run() { "$@" 2>"$STATE/ip.err" || fail "\`$*\` failed: $(cat "$STATE/ip.err")"; }

SW=${PREFIX}sw
ip netns add "$SW" 2>"$STATE/ip.err" || fail "cannot create a network namespace: $(cat "$STATE/ip.err")"
run ip -n "$SW" link add br0 type bridge
run ip -n "$SW" link set br0 up
run ip -n "$SW" link set lo up

hosts_file() {  # /etc/hosts as host $1 sees it
  echo "127.0.0.1 localhost"
  [ -z "$DEBIAN_HOSTS" ] || echo "127.0.1.1 h$1"
  for j in $(seq "$count"); do
    [ -n "$DEBIAN_HOSTS" ] && [ "$j" = "$1" ] || echo "$SUBNET.$j h$j"
  done
}

for i in $(seq "$count"); do
  ns=${PREFIX}h$i addr=$SUBNET.$i
  run ip netns add "$ns"
  # created in the root namespace under names of this cluster, moved out at once
  run ip link add "${PREFIX}a$i" type veth peer name "${PREFIX}b$i"
  run ip link set "${PREFIX}a$i" netns "$ns"
  run ip link set "${PREFIX}b$i" netns "$SW"
  run ip -n "$ns" link set "${PREFIX}a$i" name eth0
  run ip -n "$SW" link set "${PREFIX}b$i" master br0
  run ip -n "$SW" link set "${PREFIX}b$i" up
  run ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  run ip -n "$ns" addr add "$addr/24" dev eth0
  run ip -n "$ns" link set eth0 up
  run ip -n "$ns" link set lo up

  etc=/etc/netns/$ns
  mkdir -p "$etc/ssh"
  hosts_file "$i" > "$etc/hosts"
  echo "h$i" > "$etc/hostname"
  ssh-keygen -q -t ed25519 -N '' -C "h$i" -f "$etc/ssh/ssh_host_ed25519_key" || fail "ssh-keygen failed"
  key=$(cut -d' ' -f1,2 "$etc/ssh/ssh_host_ed25519_key.pub")
  echo "h$i,$addr $key" >> "$STATE/known_hosts"
  cat > "$etc/ssh/sshd_config" <<EOF
# tandem's netns cluster $PREFIX, host h$i
# every address of this namespace (its own: nothing outside the cluster reaches it)
ListenAddress 0.0.0.0
Port 22
HostKey $etc/ssh/ssh_host_ed25519_key
PidFile $STATE/sshd-h$i.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 64:30:128
MaxSessions 64
EOF
  cat > "$etc/ssh/ssh_config" <<EOF
# tandem's netns cluster $PREFIX: the cluster's client key and host keys, no prompts
Host *
  IdentityFile $STATE/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $STATE/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 5
  LogLevel ERROR
EOF
  echo "h$i $ns $addr" >> "$STATE/hosts"
done

for i in $(seq "$count"); do
  ns=${PREFIX}h$i
  # sshd daemonizes and writes its pid file; -E keeps its log out of syslog
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$1" -f "$2" -E "$3"' \
    "h$i" "$SSHD" "/etc/netns/$ns/ssh/sshd_config" "$STATE/sshd-h$i.log" \
    2>"$STATE/ip.err" || fail "sshd did not start on h$i: $(cat "$STATE/ip.err") $(tail -3 "$STATE/sshd-h$i.log" 2>/dev/null)"
done

# Ready when every host reaches every sshd (each try is bounded: ConnectTimeout, 20 tries).
for i in $(seq "$count"); do
  for j in $(seq "$count"); do
    ok=
    for _ in $(seq 20); do
      if ip netns exec "${PREFIX}h$i" ssh "h$j" true 2>"$STATE/ssh.err"; then ok=1; break; fi
      sleep 0.25
    done
    [ -n "$ok" ] || fail "h$i cannot ssh to h$j: $(cat "$STATE/ssh.err") $(tail -3 "$STATE/sshd-h$j.log" 2>/dev/null)"
  done
done
cat "$STATE/hosts"
