#!/usr/bin/env bash
# Runs the kernel crate's tests on an emulated AVX-512 VNNI CPU (Bochs' Tiger Lake model), for
# machines without one: `bash tools/emulated_avx512.sh [TEST FILTER]`. The tests boot as the
# init of a Debian kernel under Bochs and report on its serial port; the run fails unless the
# avx512-vnni path was there to test (CELLM_REQUIRE_ISA). Slow: the emulator runs a few tens
# of millions of instructions a second, so booting takes 10-20 minutes.
#
# Needs Debian's bochs, bochsbios, vgabios, isolinux, syslinux-common and xorriso (apt-get
# install), and fetches the kernel package with apt-get download. QEMU cannot stand in: its
# TCG has no AVX-512 and no AVX-VNNI.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
work="${CELLM_BOCHS_DIR:-/tmp/cellm-bochs}"
filter="${1:-}"
mkdir -p "$work/iso"
cd "$work"

# Debian 11's kernel (5.10): 6.x kernels check Bochs' inconsistent XSAVE layout data and turn
# XSAVE off, and with it every AVX path; 5.10 only warns.
if ! ls boot/vmlinuz-* >/dev/null 2>&1; then
    mirror=http://deb.debian.org/debian
    deb="$(curl -fsS "$mirror/dists/bullseye/main/binary-amd64/Packages.xz" | xz -dc |
        awk '/^Package: linux-image-5\.10\.0-[0-9]+-amd64$/ {p=1} p && /^Filename:/ {f=$2; p=0}
             END {print f}')"
    curl -fsS -o kernel.deb "$mirror/$deb"
    dpkg-deb --fsys-tarfile kernel.deb | tar -x --wildcards './boot/vmlinuz-*'
    rm kernel.deb
fi

# A static test binary, so the initramfs needs nothing else.
RUSTFLAGS="-C target-feature=+crt-static" cargo test --release -p cellm-kernels --no-run \
    --target x86_64-unknown-linux-gnu --target-dir "$work/target" \
    --manifest-path "$root/Cargo.toml" --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cellm_kernels" \
            and m["profile"]["test"] and m.get("executable"):
        print(m["executable"])
' >test-binary

# initramfs (newc cpio): the tests as /init, and /dev/console for their output.
python3 - "$(cat test-binary)" iso/initrd <<'EOF'
import sys

def entry(name, mode, data=b"", rdev=(0, 0), _ino=[0]):
    _ino[0] += 1
    fields = [_ino[0], mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0]
    head = b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0"
    head += b"\0" * (-len(head) % 4)
    return head + data + b"\0" * (-len(data) % 4)

archive = entry("dev", 0o040755) + entry("dev/console", 0o020600, rdev=(5, 1))
archive += entry("init", 0o100755, open(sys.argv[1], "rb").read()) + entry("TRAILER!!!", 0)
open(sys.argv[2], "wb").write(archive)
EOF

cp boot/vmlinuz-* iso/vmlinuz
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 iso/
# Bochs' model declares protection keys (CPUID bit 515) without their XSAVE area and gets the
# compacted XSAVE size wrong: without pku and xsaves (bit 323) the kernel keeps the AVX-512
# state, in the standard format.
cat >iso/isolinux.cfg <<EOF
default t
label t
  kernel /vmlinuz
  append initrd=/initrd console=ttyS0 quiet clearcpuid=323,515 panic=0 CELLM_REQUIRE_ISA=avx512-vnni -- --test-threads=1 $filter
EOF
xorriso -as mkisofs -quiet -o boot.iso -b isolinux.bin -c boot.cat -no-emul-boot \
    -boot-load-size 4 -boot-info-table iso

cat >bochsrc <<'EOF'
megs: 512
cpu: model=tigerlake, count=1, ips=200000000
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/vgabios/vgabios.bin
ata0-master: type=cdrom, path=boot.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=serial.out
display_library: rfb, options="timeout=0"
log: bochs.log
clock: sync=none
EOF

rm -f serial.out
# Debian's Bochs starts in its debugger: "c" continues. It runs until the tests end and the
# kernel reports init's exit.
( (echo c; sleep 3600) | timeout 3600 bochs-bin -q -f bochsrc >bochs.stdout 2>&1 ) &
bochs=$!
until grep -q -E "^test result:|Kernel panic" serial.out 2>/dev/null; do
    kill -0 "$bochs" 2>/dev/null || break
    sleep 10
done
pkill -f "bochs-bin -q -f bochsrc" || true
grep -E "^(test |running |test result:|kernel paths)|panicked" serial.out || true
grep -q "^test result: ok" serial.out
