#!/bin/sh
# The BLAKE3 team's C implementation of blake3 (CC0-1.0 or Apache-2.0), which
# castore's optional extension castore.format._b3tree is built from (setup.py). It comes
# from Debian's package librust-blake3-dev (the Rust crate's sources, whose c/
# folder is that implementation), unpacked into build/blake3-c/; nothing is
# installed. Without it castore still works: reads of part of a chunk then read
# and verify the whole chunk (docs/FORMAT.md, "Chunk pieces").
set -u
dest=build/blake3-c
[ -f "$dest/blake3.c" ] && exit 0
command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 || {
    echo "no apt-get here: castore builds without castore.format._b3tree (partial chunk reads verify whole chunks)"
    exit 0
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching the BLAKE3 C sources (Debian's librust-blake3-dev, about 0.4 MB) into $dest ..."
if ! (cd "$tmp" && apt-get download librust-blake3-dev >/dev/null 2>&1); then
    # A fresh machine may have no package lists yet.
    apt-get update -qq >/dev/null 2>&1
    if ! (cd "$tmp" && apt-get download librust-blake3-dev >/dev/null 2>&1); then
        echo "could not fetch librust-blake3-dev: castore builds without castore.format._b3tree"
        exit 0
    fi
fi
dpkg -x "$tmp"/librust-blake3-dev_*.deb "$tmp/x"
src=$(ls -d "$tmp"/x/usr/share/cargo/registry/blake3-*/c | head -n 1)
mkdir -p "$dest"
cp "$src"/*.c "$src"/*.h "$src"/*.S "$dest"/
