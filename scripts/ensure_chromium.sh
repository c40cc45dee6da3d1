#!/bin/sh
# Prints the path of a headless Chromium for the slim report's screenshot test (tests/test_slim_report.py).
# Where none is on PATH and we are root with apt-get, installs Debian/Ubuntu's `chromium` (no recommends);
# otherwise prints one line saying the test will be skipped and why. Always exits 0: the set-up must not
# fail for a browser that only one test needs.

find_browser() {
    for name in chromium chromium-browser google-chrome; do
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

if find_browser; then
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "no Chromium on PATH and not root: the report screenshot test will be skipped (install chromium to run it)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "no Chromium on PATH and no apt-get: the report screenshot test will be skipped (install chromium to run it)"
    exit 0
fi

echo "installing chromium from the system's packages (apt-get, no recommends) for the report screenshot test" >&2
log=$(mktemp)
if DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$log" 2>&1 &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >>"$log" 2>&1 &&
    find_browser; then
    rm -f "$log"
    exit 0
fi
echo "apt-get could not install chromium ($(tail -n 1 "$log")): the report screenshot test will be skipped"
rm -f "$log"
exit 0
