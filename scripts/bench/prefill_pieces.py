"""Where one prompt chunk's time goes: each piece of a GDN, an attention and a MoE layer, timed alone.

Each piece runs on `--rows` random rows (one prompt chunk) of the model's first layer of each
kind, attention over `--offset` earlier cells plus the chunk, and is timed as strata runs it
and, where strata's prompt path has its own form, in the plain form next to it (`x @ W.T`,
`mx.fast.scaled_dot_product_attention`, experts gathered against `w.swapaxes`), in one run.
Times are medians of `--repeats` of this process's CPU time (`time.process_time`), which a
shared machine disturbs less than wall time; `--wall` times wall-clock instead.

    python -m scripts.bench.prefill_pieces                                         # demo model, 512 rows at offset 2,048
    python -m scripts.bench.prefill_pieces --synthetic-tiny --rows 64 --offset 64  # seconds: checks the script
    python -m scripts.bench.prefill_pieces --synthetic 80b --device gpu --rows 2048 --wall --gdn-chunks 32,64,128
        # the 80B-A3B shape (4-bit, bfloat16, built as prefill_bench builds it) on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from scripts.bench.prefill_bench import SETTINGS, SYNTHETIC, build_synthetic, setting
from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
from strata_cli.model.attention import causal_attention_cpu
from strata_cli.model.gdn import gated_delta_scan, l2_normalize
from strata_cli.model.gdn_chunked import chunked_gated_delta_scan
from strata_cli.model.layer_state import GDNRows
from strata_cli.model.moe import gather_matmul, glu_by_expert
from strata_cli.options import LoadOptions
from strata_cli.runtime import open_model


def median_ms(fn, repeats: int, clock) -> float:
    mx.eval(fn())
    runs = []
    for _ in range(repeats):
        start = clock()
        mx.eval(fn())
        runs.append(clock() - start)
    return statistics.median(runs) * 1e3


def plain_linear(layer, x):
    return x @ layer["weight"].T


def _in_setting(key: str, value: str, fn):
    with setting(key, value):
        return fn()


def pieces(model, rows: int, offset: int, *, with_reference: bool = True, gdn_chunks: tuple[int, ...] = (),
           expert_forms: tuple[str, ...] = ()):
    """[(piece, strata fn, plain fn or None)] for one chunk of `rows` rows of each layer kind;
    `gdn_chunks`: also the chunked scan at these chunk sizes (the constant to tune per backend);
    `expert_forms`: also the routed experts in these GPU prompt forms (`moe.GPU_PROMPT_EXPERTS`)."""
    layers = model.layers
    gdn_layer = next(layer for layer in layers if layer.is_linear)
    attn_layer = next(layer for layer in layers if not layer.is_linear)
    H = model.config.hidden_size
    dtype = gdn_layer.input_layernorm.weight.dtype
    x = mx.random.normal((1, rows, H), key=mx.random.key(0)).astype(dtype)
    g, at, moe = gdn_layer.linear_attn, attn_layer.self_attn, gdn_layer.mlp
    raw, z, b, a = g.project(x)
    window = mx.concatenate([mx.zeros((1, g.conv_kernel - 1, raw.shape[-1]), dtype=raw.dtype), raw], axis=1)
    mixed = nn.silu(g.conv1d(window))
    gdn_rows = _gdn_rows(g, mixed, b, a)
    S0 = mx.zeros((1, g.num_v_heads, g.head_k_dim, g.head_v_dim))
    y = g.norm(chunked_gated_delta_scan(gdn_rows, S0)[0].astype(x.dtype), z).reshape(1, rows, -1)
    L = offset + rows
    kq, kk, kv = mx.random.split(mx.random.key(1), 3)
    q = mx.random.normal((1, at.num_heads, rows, at.head_dim), key=kq).astype(dtype)
    k = mx.random.normal((1, at.num_kv_heads, L, at.head_dim), key=kk).astype(dtype)
    v = mx.random.normal((1, at.num_kv_heads, L, at.head_dim), key=kv).astype(dtype)
    o = mx.random.normal((1, rows, at.num_heads * at.head_dim), key=kq).astype(dtype)
    on_cpu = mx.default_device() == mx.cpu

    def attention_core():  # what strata's prompt path runs on this device
        if on_cpu:
            return causal_attention_cpu(q, k, v, at.scale)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=at.scale, mask="causal")

    xf = x.reshape(-1, H)
    inds, _ = moe.route(xf)
    mx.eval(x, raw, window, mixed, y, q, k, v, o, inds, *vars(gdn_rows).values())
    sw = moe.switch_mlp
    plain = with_reference
    return [
        ("norm", lambda: gdn_layer.input_layernorm(x), None),
        ("gdn in_proj (qkvz, ba)", lambda: [g.in_proj_qkvz(x), g.in_proj_ba(x)],
         plain and (lambda: [plain_linear(g.in_proj_qkvz, x), plain_linear(g.in_proj_ba, x)])),
        ("gdn conv + silu", lambda: nn.silu(g.conv1d(window)), None),
        ("gdn q/k norm, gates", lambda: list(vars(_gdn_rows(g, mixed, b, a)).values()), None),
        ("gdn scan (chunked / per row)", lambda: chunked_gated_delta_scan(gdn_rows, S0),
         plain and (lambda: gated_delta_scan(gdn_rows, S0))),
        ("gdn gated norm", lambda: g.norm(y.reshape(1, rows, g.num_v_heads, -1), z), None),
        ("gdn out_proj", lambda: g.out_proj(y), plain and (lambda: plain_linear(g.out_proj, y))),
        ("attn q/k/v proj", lambda: [at.q_proj(x), at.k_proj(x), at.v_proj(x)],
         plain and (lambda: [plain_linear(at.q_proj, x), plain_linear(at.k_proj, x), plain_linear(at.v_proj, x)])),
        (f"attn core (L={L})", attention_core,
         plain and on_cpu and (lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=at.scale, mask="causal"))),
        ("attn o_proj", lambda: at.o_proj(o), plain and (lambda: plain_linear(at.o_proj, o))),
        ("moe router + top-k", lambda: list(moe.route(xf)), None),
        ("moe experts", lambda: sw(xf, inds),
         plain and isinstance(sw["gate_proj"], mx.array)  # a plain gather of unquantized experts
         and (lambda: glu_by_expert(xf, inds, lambda n, xs, e, s: gather_matmul(xs, sw[n], e, is_sorted=s)))),
        ("moe shared expert", lambda: moe.shared_expert(xf),
         plain and (lambda: _plain_mlp(moe.shared_expert, xf))),
        ("moe block (whole)", lambda: moe(x), None),
        *[(f"moe experts, GPU form {form}", lambda form=form: _in_setting("experts", form, lambda: sw(xf, inds)),
           None) for form in expert_forms],
        *[(f"gdn scan, chunk {c}", lambda c=c: chunked_gated_delta_scan(gdn_rows, S0, chunk=c), None)
          for c in gdn_chunks],
    ]


def _gdn_rows(g, mixed, b, a) -> GDNRows:
    B, T, _ = mixed.shape
    q, k, v = mx.split(mixed, [g.key_dim, 2 * g.key_dim], axis=-1)
    q = l2_normalize(q.reshape(B, T, g.num_k_heads, g.head_k_dim)) * g.head_k_dim**-0.5
    k = l2_normalize(k.reshape(B, T, g.num_k_heads, g.head_k_dim))
    v = v.reshape(B, T, g.num_v_heads, g.head_v_dim).astype(mx.float32)
    beta = mx.sigmoid(b.astype(mx.float32))
    decay = -mx.exp(g.A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + g.dt_bias.astype(mx.float32))
    return GDNRows(q, k, v, decay, beta)


def _plain_mlp(mlp, x):
    return plain_linear(mlp.down_proj, nn.silu(plain_linear(mlp.gate_proj, x)) * plain_linear(mlp.up_proj, x))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="checkpoint directory or 'demo' (default demo)")
    parser.add_argument("--synthetic-tiny", action="store_true", help="a tiny random model instead of --model")
    parser.add_argument("--synthetic", choices=SYNTHETIC, default=None,
                        help="a random model of this shape, 4-bit and bfloat16, built as prefill_bench builds it")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--gdn-chunks", default="", help="also time the chunked scan at these chunk sizes, e.g. 32,64")
    parser.add_argument("--expert-forms", default="",
                        help="also time the routed experts in these GPU prompt forms, e.g. padded,gather")
    parser.add_argument("--rows", type=int, default=512, help="rows of the chunk (default 512, PREFILL_CHUNK)")
    parser.add_argument("--offset", type=int, default=2048, help="earlier cells attention sees (default 2048)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of this process's CPU time")
    parser.add_argument("--out", type=Path, default=None, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    if args.rows < 16 or args.offset < 0 or args.repeats < 1:
        parser.error("--rows must be at least 16 (a prompt chunk), --offset at least 0, --repeats at least 1")
    forms = SETTINGS["experts"][2]
    if any(f not in forms for f in args.expert_forms.split(",") if f):
        parser.error(f"--expert-forms takes {', '.join(forms)}, got {args.expert_forms!r}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    reference = not args.synthetic  # the plain forms are float32 ones; a synthetic model is quantized
    if args.synthetic:
        model, _ = build_synthetic(args.synthetic, layers=4, bits=4, group_size=64, dtype=mx.bfloat16, seed=0)
    elif args.synthetic_tiny:
        model = random_model(tiny_qwen3_next_config(max_position_embeddings=args.offset + args.rows))
    else:
        model = open_model(LoadOptions(model=args.model, dtype="float32")).model
    clock = time.perf_counter if args.wall else time.process_time
    table = []
    chunks = tuple(int(c) for c in args.gdn_chunks.split(",") if c)
    forms = tuple(f for f in args.expert_forms.split(",") if f)
    for name, fn, plain in pieces(model, args.rows, args.offset, with_reference=reference, gdn_chunks=chunks,
                                  expert_forms=forms):
        row = {"piece": name, "strata_ms": median_ms(fn, args.repeats, clock)}
        if plain:
            row["plain_ms"] = median_ms(plain, args.repeats, clock)
        table.append(row)
    print(f"{args.rows} rows at offset {args.offset}, {args.synthetic or 'float32'} {args.device}, median of {args.repeats} "
          f"({'wall' if args.wall else 'CPU'} ms)")
    print("| piece | strata ms | plain form ms |")
    print("|---|---|---|")
    for row in table:
        plain = f"{row['plain_ms']:.1f}" if "plain_ms" in row else ""
        print(f"| {row['piece']} | {row['strata_ms']:.1f} | {plain} |")
    if args.out:
        args.out.write_text(json.dumps(table, indent=1) + "\n")
    return table


if __name__ == "__main__":
    main()
