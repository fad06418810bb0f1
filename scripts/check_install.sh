#!/usr/bin/env bash
# Install reshard as a user does (`pip install reshard`: no extras) into a fresh venv, at this platform's
# versions (constraints.txt), and show that it converts and verifies with torch absent and that nothing
# but the `reshard` package was installed. Runs from a temporary directory, so the repository's own
# folders (converters/, trainer/, fixtures/) are not on sys.path.
set -euo pipefail
unset PYTHONPATH  # a fresh venv means only what pip installed there
REPO="$(cd "$(dirname "$0")/.." && pwd)"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/reshard-install.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'check_install: FAILED: %s\n' "$*" >&2; exit 1; }

step "fresh venv, pip install reshard (no extras)"
python3 -m venv venv
PY="$TMP/venv/bin/python"
"$PY" -m pip install -q --upgrade pip
# From a copy of the work tree's files (tracked and untracked, not ignored): the build neither leaves
# build/ or *.egg-info in the work tree nor picks up a stale build/ from an earlier one.
mkdir src
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
   | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
   | xargs -0 cp --parents -t "$TMP/src")
"$PY" -m pip install -q "$TMP/src" -c "$REPO/constraints.txt"

step "torch and megatron-core are absent"
if "$PY" -c "import torch" 2>/dev/null; then fail "torch is importable after pip install reshard"; fi
if "$PY" -c "import megatron.core" 2>/dev/null; then fail "megatron-core is importable after pip install reshard"; fi
echo "import torch: fails, as it should"

step "only the reshard package is installed"
"$PY" - "$REPO" <<'EOF'
import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

dist = md.distribution("reshard")
tops = sorted({f.parts[0] for f in dist.files if f.parts[0] not in ("..",) and not f.parts[0].endswith(".dist-info")})
assert tops == ["reshard"], f"reshard installs top-level {tops}"
# Every module of the three folders is installed (pyproject.toml lists the packages by name).
repo = Path(sys.argv[1])
want = {("reshard", *p.relative_to(repo / d).parts) for d in ("reshard",) for p in (repo / d).rglob("*.py")}
want |= {("reshard", d, *p.relative_to(repo / d).parts) for d in ("converters", "trainer") for p in (repo / d).rglob("*.py")}
have = {f.parts for f in dist.files if f.suffix == ".py"}
assert want <= have, f"not installed: {sorted('/'.join(p) for p in want - have)}"
for name in ("fixtures", "converters", "trainer", "tests"):
    assert importlib.util.find_spec(name) is None, f"a top-level {name!r} is importable"
import reshard.converters
import reshard.trainer  # its __init__ imports nothing; running it needs reshard[trainer]

print("installed top-level:", tops)
print("reshard.converters from", reshard.converters.__file__)
EOF

step "a tiny HF Llama, written with numpy alone"
"$PY" - <<'EOF'
import json
import struct
from pathlib import Path

import numpy as np

out = Path("hf")
out.mkdir()
hidden, inter, layers, heads, kv, vocab = 64, 128, 2, 4, 2, 250
head_dim = hidden // heads
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
    "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
    "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 0, "eos_token_id": 1,
}
shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
for i in range(layers):
    p = f"model.layers.{i}."
    shapes |= {
        p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
        p + "self_attn.v_proj.weight": (kv * head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
    }
rng = np.random.default_rng(0)
header, blobs, offset = {}, [], 0
for name, shape in shapes.items():
    data = (rng.standard_normal(shape) * 0.1).astype("<f4").tobytes()
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
head = json.dumps(header, separators=(",", ":")).encode()
head += b" " * (-len(head) % 8)
(out / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
(out / "config.json").write_text(json.dumps(config, indent=2))
print(f"{len(shapes)} tensors, {offset} bytes")
EOF

R="$TMP/venv/bin/reshard"
step "reshard inspect hf"
"$R" inspect hf
step "reshard convert hf -> torch_dist TP2 PP2"
"$R" convert hf mcore --to-format torch_dist --to-tp 2 --to-pp 2 -q
step "reshard convert torch_dist -> zarr"
"$R" convert mcore store.zarr --to-format zarr -q
step "reshard convert zarr -> hf"
"$R" convert store.zarr hf-back --to-format hf -q
step "reshard verify"
"$R" verify mcore
"$R" verify hf-back --against hf
"$R" verify store.zarr --against mcore
if "$PY" -c "import torch" 2>/dev/null; then fail "torch appeared during the run"; fi
printf '\ncheck_install: OK (pip install reshard converts and verifies without torch; only reshard/ installed)\n'
