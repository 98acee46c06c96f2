#!/usr/bin/env bash
# Make sure Debian's Chromium is at /usr/bin/chromium for the browser tests.
#
# The browser tests drive the *system* Chromium through playwright rather than
# `playwright install`, which downloads its own browser build from a CDN: package
# registries are the only network some machines (CI included) can reach.
# Installs with apt-get when we are root (or have password-less sudo); otherwise it
# only explains, and the browser tests skip. Under CI=true a failed install is fatal,
# so a green CI run really did exercise the browser.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "[chromium] no apt-get here; install Chromium at /usr/bin/chromium yourself" \
         "or the browser tests will skip"
    [ -z "${CI:-}" ] || exit 1
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "[chromium] /usr/bin/chromium is missing and we are not root:" \
         "run 'sudo apt-get install chromium' to enable the browser tests (they skip)"
    [ -z "${CI:-}" ] || exit 1
    exit 0
fi
echo "[chromium] installing Debian's chromium package (browser tests need it)"
if $SUDO apt-get update -qq && \
   DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium \
       </dev/null >/tmp/minikv-apt.log 2>&1; then
    echo "[chromium] installed: $(/usr/bin/chromium --version 2>/dev/null || echo '?')"
else
    tail -20 /tmp/minikv-apt.log || true
    echo "[chromium] apt-get install chromium failed; the browser tests will skip"
    [ -z "${CI:-}" ] || exit 1
fi
