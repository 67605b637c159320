#!/usr/bin/env bash
# Create (or reuse) .venv and install tandem with everything its demo and tests need.
# Needs nothing but python3. torch is pinned: an unpinned torch pulls several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".[mpi,test,examples,tensorboard,notebook,lightning,hf,docs]"
# The multi-host tests (tests/test_cluster.py, scripts/netns-cluster.sh) need sshd on every
# "host", and iptables to shape its link: Debian's packages are installed when we are root
# with apt-get, without starting this machine's own sshd (a policy-rc.d that says no, for the
# install only: the tests start sshds of their own, inside network namespaces). Elsewhere those
# tests skip and say why.
missing=
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || missing+=" openssh-server openssh-client"
command -v iptables >/dev/null || [ -x /usr/sbin/iptables ] || missing+=" iptables"
# The documentation site's browser test (tests/test_docs_site.py) drives Debian's chromium
# through its chromedriver; elsewhere that test skips and says why.
command -v chromium >/dev/null || missing+=" chromium"
command -v chromedriver >/dev/null || missing+=" chromium-driver"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    policy=1
  fi
  # shellcheck disable=SC2086  # the package names split on purpose
  { DEBIAN_FRONTEND=noninteractive apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing; \
  } >/dev/null 2>&1 || echo "setup: could not install$missing; the multi-host and browser tests will skip" >&2
  [ -z "$policy" ] || rm -f /usr/sbin/policy-rc.d
fi
