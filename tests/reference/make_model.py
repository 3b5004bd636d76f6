#!/usr/bin/env python3
"""Writes a random-weight GGUF model of the llama, qwen2 or starcoder2 architecture.

The file is laid out as llama.cpp's own converter (convert_hf_to_gguf.py: LlamaModel, Qwen2Model,
StarCoder2Model) lays out these architectures: the same tensor names, shapes and types, the same
metadata keys, Q and K of llama permuted as the converter permutes them (so llama.cpp's "norm" rope
on them is Hugging Face's rotate-half rope on the unpermuted weights). It is written with gguf-py,
llama.cpp's GGUF package (MIT), which .ci/setup lays out in .cache/llama.cpp/gguf-py; nothing of
llama.cpp is copied here. Needs numpy (and yaml, which gguf-py imports): Debian's python3-numpy and
python3-yaml (run it with /usr/bin/python3 where another python3 comes first in PATH).

Weights are normal random numbers from numpy's default_rng(seed), drawn in the same order whatever
--type is, so the f16, bf16, q8_0 and q4_0 files of one seed hold roundings of the same f32 weights.
Scales keep activations O(1) and the logits neither flat nor one-hot: every projection is scaled by
1/sqrt(fan_in), the projections that end a residual branch (attn_output, ffn_down) additionally by
1/sqrt(2 * layers); norm weights are 1 + 0.1 N(0, 1); biases 0.05 N(0, 1); token_embd has unit
entries (1/sqrt(hidden) when the output is tied to it, so that the logits keep unit scale).

Example:
  python3 tests/reference/make_model.py --arch qwen2 --type f16 --hidden 768 --layers 12 --heads 12 \
      --kv-heads 2 --ffn 2048 --vocab ../shared/data/vocab/ggml-vocab-qwen2.5-coder.gguf \
      --pad-vocab 151936 model.gguf
"""

from __future__ import annotations

import argparse
import os
import pathlib
import struct
import sys


def gguf_py_dir() -> pathlib.Path:
    env = os.environ.get("EFIM_GGUF_PY")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[2] / ".cache" / "llama.cpp" / "gguf-py"


sys.path.insert(0, str(gguf_py_dir()))
try:
    import numpy as np
    import gguf
except ImportError as e:  # pragma: no cover - reported to the user
    sys.stderr.write(f"make_model.py: {e}; needs numpy, yaml and gguf-py ({gguf_py_dir()}, "
                     "set EFIM_GGUF_PY or run .ci/setup)\n")
    sys.exit(2)

ARCHES = {
    # name: (gguf arch, normalization, default rope base, default norm epsilon)
    "llama": (gguf.MODEL_ARCH.LLAMA, "rms", 10000.0, 1e-5),
    "qwen2": (gguf.MODEL_ARCH.QWEN2, "rms", 1000000.0, 1e-6),
    "starcoder2": (gguf.MODEL_ARCH.STARCODER2, "layer", 1000000.0, 1e-5),
}

TYPES = {
    # name: (tensor type of the 2-D matrices, general.file_type)
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=sorted(ARCHES))
    p.add_argument("--type", default="f32", choices=list(TYPES),
                   help="type of the 2-D weight matrices, token_embd and output included (default f32)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--ffn", type=int, default=None, help="default: 4 * --hidden")
    p.add_argument("--context", type=int, default=4096, help="{arch}.context_length (default 4096)")
    p.add_argument("--rope-base", type=float, default=None,
                   help="rope.freq_base (default 1e4 for llama, 1e6 for qwen2 and starcoder2)")
    p.add_argument("--norm-eps", type=float, default=None,
                   help="RMSNorm (llama 1e-5, qwen2 1e-6) or LayerNorm (starcoder2 1e-5) epsilon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tied", action="store_true", help="no output.weight: the output is token_embd")
    p.add_argument("--rope-scaling", choices=["linear"], default=None)
    p.add_argument("--rope-scaling-factor", type=float, default=None)
    p.add_argument("--vocab", default=None,
                   help="a GGUF whose tokenizer.* metadata is copied (e.g. ../shared/data/vocab/*.gguf)")
    p.add_argument("--pad-vocab", type=int, default=None,
                   help="pad the token list to N with [PAD{i}] tokens of type UNUSED (as the Qwen2 converter does)")
    p.add_argument("--vocab-size", type=int, default=256,
                   help="without --vocab: the number of tokens of a tokenizer-less ('none') vocabulary")
    p.add_argument("out", metavar="OUT")
    a = p.parse_args(argv)

    arch, _, rope_base, norm_eps = ARCHES[a.arch]
    a.kv_heads = a.heads if a.kv_heads is None else a.kv_heads
    a.ffn = 4 * a.hidden if a.ffn is None else a.ffn
    a.rope_base = rope_base if a.rope_base is None else a.rope_base
    a.norm_eps = norm_eps if a.norm_eps is None else a.norm_eps
    if min(a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.context) <= 0:
        p.error("sizes must be positive")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if (a.hidden // a.heads) % 2:
        p.error("the head size must be even (rope rotates pairs)")
    if (a.rope_scaling is None) != (a.rope_scaling_factor is None):
        p.error("--rope-scaling and --rope-scaling-factor go together")
    if a.rope_scaling_factor is not None and a.rope_scaling_factor <= 0:
        p.error("--rope-scaling-factor must be positive")
    if a.pad_vocab is not None and a.vocab is None:
        p.error("--pad-vocab needs --vocab")
    return a


def read_tokenizer(path: str) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The tokenizer.* keys of a GGUF, as (key, value, type, array element type), strings as raw bytes.

    Reads the key-value section directly (gguf-py's GGUFReader takes ~10 s over the ~300,000 strings
    of a Qwen vocabulary; this takes well under one)."""
    T = gguf.GGUFValueType
    scalar = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
              T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}
    with open(path, "rb") as f:
        buf = f.read()
    if buf[:4] != b"GGUF":
        raise SystemExit(f"make_model.py: {path} is not a GGUF file")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise SystemExit(f"make_model.py: {path}: GGUF version {version} is not supported")
    pos = 24

    def string() -> bytes:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return buf[pos - n:pos]

    def value(vtype: gguf.GGUFValueType) -> object:
        nonlocal pos
        if vtype == T.STRING:
            return string()
        fmt = scalar[vtype]
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    keys = []
    for _ in range(n_kv):
        key = string().decode()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        vtype = T(vtype)
        if vtype == T.ARRAY:
            sub, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            sub = T(sub)
            if sub == T.STRING:
                v = [string() for _ in range(n)]
            elif sub == T.ARRAY:
                raise SystemExit(f"make_model.py: {path}: nested array {key} is not supported")
            else:
                dtype = np.dtype(scalar[sub])
                v = np.frombuffer(buf, dtype=dtype, count=n, offset=pos).tolist()
                pos += n * dtype.itemsize
            if key.startswith("tokenizer."):
                keys.append((key, v, vtype, sub))
        else:
            v = value(vtype)
            if key.startswith("tokenizer."):
                keys.append((key, v, vtype, None))
    if not any(k == gguf.Keys.Tokenizer.LIST for k, *_ in keys):
        raise SystemExit(f"make_model.py: {path} has no {gguf.Keys.Tokenizer.LIST}")
    return keys


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    arch, norm, _, _ = ARCHES[a.arch]
    qtype, ftype = TYPES[a.type]
    H, L, F = a.hidden, a.layers, a.ffn
    head_dim = H // a.heads
    kv_dim = head_dim * a.kv_heads

    # Vocabulary: copied tokenizer metadata (padded as the Qwen2 converter pads), or none.
    tokenizer = read_tokenizer(a.vocab) if a.vocab else []
    if tokenizer:
        tokens = next(v for k, v, *_ in tokenizer if k == gguf.Keys.Tokenizer.LIST)
        types = next((v for k, v, *_ in tokenizer if k == gguf.Keys.Tokenizer.TOKEN_TYPE), None)
        if a.pad_vocab is not None:
            if a.pad_vocab < len(tokens):
                raise SystemExit(f"make_model.py: --pad-vocab {a.pad_vocab} is below the {len(tokens)} tokens of {a.vocab}")
            for i in range(len(tokens), a.pad_vocab):
                tokens.append(f"[PAD{i}]".encode())
                if types is not None:
                    types.append(int(gguf.TokenType.UNUSED))
        n_vocab = len(tokens)
    else:
        n_vocab = a.vocab_size

    w = gguf.GGUFWriter(a.out, gguf.MODEL_ARCH_NAMES[arch])

    # Metadata, as the converter writes it (TextModel.set_gguf_parameters and the model classes).
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"efim random {a.arch} {a.type} seed {a.seed}")
    w.add_block_count(L)
    w.add_context_length(a.context)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    if a.rope_scaling == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(a.rope_scaling_factor)
    w.add_rope_freq_base(a.rope_base)
    if norm == "rms":
        w.add_layer_norm_rms_eps(a.norm_eps)
    else:
        w.add_layer_norm_eps(a.norm_eps)
    if a.arch == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer:
        for key, value, vtype, sub in tokenizer:
            w.add_key_value(key, value, vtype, sub_type=sub)
    else:
        # No tokenizer: llama.cpp then makes vocab_size dummy tokens (LLAMA_VOCAB_TYPE_NONE).
        w.add_tokenizer_model("none")
        if a.arch != "llama":
            w.add_vocab_size(n_vocab)

    rng = np.random.default_rng(a.seed)
    fallbacks: list[str] = []

    def normal(shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    def matrix(name: str, data: np.ndarray) -> None:
        # 2-D weights in --type (quantized by gguf-py as the converter does; a row that does not fill
        # whole blocks falls back to F16, as in the converter).
        t = qtype
        try:
            q = gguf.quants.quantize(data, t)
        except gguf.QuantError:
            t = gguf.GGMLQuantizationType.F16
            q = gguf.quants.quantize(data, t)
            fallbacks.append(name)
        w.add_tensor(name, q, raw_dtype=t)

    def vector(name: str, data: np.ndarray) -> None:
        w.add_tensor(name, data.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)

    def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
        # As LlamaModel.permute: Hugging Face's q_proj/k_proj rows reordered for the "norm" rope,
        # n_head being the heads of that projection.
        return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
                .swapaxes(1, 2)
                .reshape(weights.shape))

    branch = 1.0 / np.sqrt(2.0 * L)
    matrix("token_embd.weight", normal((n_vocab, H), 1.0 / np.sqrt(H) if a.tied else 1.0))
    for i in range(L):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", 1.0 + normal((H,), 0.1))
        if norm == "layer":
            vector(p + "attn_norm.bias", normal((H,), 0.05))
        wq = normal((H, H), 1.0 / np.sqrt(H))
        wk = normal((kv_dim, H), 1.0 / np.sqrt(H))
        wv = normal((kv_dim, H), 1.0 / np.sqrt(H))
        if a.arch == "llama":
            wq = permute(wq, a.heads)
            wk = permute(wk, a.kv_heads)
        matrix(p + "attn_q.weight", wq)
        matrix(p + "attn_k.weight", wk)
        matrix(p + "attn_v.weight", wv)
        if a.arch in ("qwen2", "starcoder2"):
            vector(p + "attn_q.bias", normal((H,), 0.05))
            vector(p + "attn_k.bias", normal((kv_dim,), 0.05))
            vector(p + "attn_v.bias", normal((kv_dim,), 0.05))
        matrix(p + "attn_output.weight", normal((H, H), branch / np.sqrt(H)))
        if a.arch == "starcoder2":
            vector(p + "attn_output.bias", normal((H,), 0.05))
        vector(p + "ffn_norm.weight", 1.0 + normal((H,), 0.1))
        if norm == "layer":
            vector(p + "ffn_norm.bias", normal((H,), 0.05))
        if a.arch == "starcoder2":
            # GELU MLP: c_fc -> ffn_up, c_proj -> ffn_down, both with biases.
            matrix(p + "ffn_up.weight", normal((F, H), 1.0 / np.sqrt(H)))
            vector(p + "ffn_up.bias", normal((F,), 0.05))
            matrix(p + "ffn_down.weight", normal((H, F), branch / np.sqrt(F)))
            vector(p + "ffn_down.bias", normal((H,), 0.05))
        else:
            # SwiGLU: down(silu(gate x) * up x)
            matrix(p + "ffn_gate.weight", normal((F, H), 1.0 / np.sqrt(H)))
            matrix(p + "ffn_up.weight", normal((F, H), 1.0 / np.sqrt(H)))
            matrix(p + "ffn_down.weight", normal((H, F), branch / np.sqrt(F)))
    vector("output_norm.weight", 1.0 + normal((H,), 0.1))
    if norm == "layer":
        vector("output_norm.bias", normal((H,), 0.05))
    if not a.tied:
        matrix("output.weight", normal((n_vocab, H), 1.0 / np.sqrt(H)))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    if fallbacks:
        sys.stderr.write(f"make_model.py: rows of {len(fallbacks)} tensors do not fill {a.type} blocks; "
                         f"those are F16: {', '.join(fallbacks)}\n")
    print(f"{a.out}: {a.arch} {a.type}, hidden {H}, {L} layers, {a.heads} heads ({a.kv_heads} kv, head size "
          f"{head_dim}), ffn {F}, vocab {n_vocab}{' (' + os.path.basename(a.vocab) + ')' if a.vocab else ' (no tokenizer)'}, "
          f"{'tied' if a.tied else 'untied'} output, rope base {a.rope_base:g}"
          f"{f', linear rope scaling {a.rope_scaling_factor:g}' if a.rope_scaling else ''}, "
          f"norm eps {a.norm_eps:g}, seed {a.seed}, {os.path.getsize(a.out) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
