#!/usr/bin/env bash
# Installs what the fuzz targets need: a nightly toolchain (libFuzzer's sanitizer flags) and
# cargo-fuzz from crates.io.
set -euo pipefail
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
cargo +nightly fuzz --version
