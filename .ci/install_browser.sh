#!/usr/bin/env bash
# Install what tests/project/test_browser.py needs, if missing: Debian's chromium and the Playwright Python driver;
# and what test_site.py's accessibility test needs: axe-core 4.x, npm's package, into build/axe/ (its axe.min.js is
# 650 kB: fetched here, not kept in the repository). Idempotent: does nothing when all are there. Never runs
# `playwright install` (it would download its own browser).
# Without root/apt the browser test skips itself; set REQUIRE_BROWSER=1 to make a failed install an error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"

fail() {
    echo "install_browser: $1" >&2
    if [ "${REQUIRE_BROWSER:-0}" = "1" ]; then exit 1; fi
    echo "install_browser: tests/project/test_browser.py will be skipped" >&2
    exit 0
}

if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    if [ "$(id -u)" != "0" ]; then
        command -v sudo >/dev/null && sudo -n true 2>/dev/null && SUDO="sudo -n" || fail "chromium is missing and apt-get needs root"
    fi
    command -v apt-get >/dev/null || fail "chromium is missing and this is not a Debian/Ubuntu system (no apt-get)"
    ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium) \
        > /tmp/ci-apt-chromium.log 2>&1 || fail "apt-get install chromium failed (see /tmp/ci-apt-chromium.log)"
fi

if ! "$PY" -c "import playwright.sync_api" 2>/dev/null; then
    "$PY" -m pip install -q playwright > /tmp/ci-pip-playwright.log 2>&1 \
        || fail "pip install playwright failed (see /tmp/ci-pip-playwright.log)"
fi

AXE_DIR=build/axe
if [ ! -f "$AXE_DIR/node_modules/axe-core/axe.min.js" ]; then
    if ! command -v npm >/dev/null; then
        [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null || fail "npm is missing (Debian package npm) for axe-core"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm) \
            > /tmp/ci-apt-npm.log 2>&1 || fail "apt-get install npm failed (see /tmp/ci-apt-npm.log)"
    fi
    npm install --no-save --no-package-lock --prefix "$AXE_DIR" "axe-core@4" > /tmp/ci-npm-axe.log 2>&1 \
        || fail "npm install axe-core failed (see /tmp/ci-npm-axe.log)"
fi

echo "install_browser: $(/usr/bin/chromium --version 2>/dev/null | head -1); playwright $("$PY" -c 'from importlib.metadata import version; print(version("playwright"))'); axe-core $(sed -n 's/.*"version": "\([^"]*\)".*/\1/p' "$AXE_DIR/node_modules/axe-core/package.json" | head -1)"
