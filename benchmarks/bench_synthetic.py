"""Speculative decoding at realistic sizes: random-weight targets of published shapes, measured
against the device's memory bandwidth, with an oracle drafter of controlled acceptance.

For every shape, dtype and batch size, side by side in one process:
  * plain decoding (the `generate` loop, prefill excluded): ms per step, and the fraction of the
    memory-bandwidth limit it reaches (weights read per step + the average cache read, over the
    bandwidth of a device-to-device copy measured here);
  * the verify cost: one target pass over T = 1, 2, .. tokens relative to T = 1;
  * speculative decoding (the fused `speculative_generate` loop, prefill excluded) with the
    `Oracle` drafter: it proposes the target's own greedy continuation, each draft kept with
    probability alpha, at no cost. tau is measured; the ideal speedup is tau / verify_cost(k)
    (a step that costs only its verify pass); machinery efficiency = achieved / ideal.

    python benchmarks/bench_synthetic.py --shapes llama-3.2-1b --dtypes float32 --batch 1
    python benchmarks/bench_synthetic.py --shapes tiny --new-tokens 32   # CPU smoke run

Writes JSON (and a plot with --plot) and prints a table; the machine and versions are recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, forward_costs, machine, write_json  # noqa: E402

import importlib  # noqa: E402

from jaxspec.decoding import loop  # noqa: E402
from jaxspec.decoding import plain as plain_lib  # noqa: E402
from jaxspec.decoding.loop import resolve_policy  # noqa: E402
from jaxspec.models.llama import LlamaLM  # noqa: E402
llama_lib = importlib.import_module("jaxspec.models.llama")
from jaxspec.drafters import Oracle  # noqa: E402
from jaxspec.engine import Engine, io, runs  # noqa: E402
from jaxspec.models.llama import is_scanned, with_scan_layers  # noqa: E402
from jaxspec.models.synthetic import random_model  # noqa: E402
from jaxspec.sampling import GREEDY  # noqa: E402


def device_bandwidth(gib: float) -> dict:
  """The device memory's bandwidth in bytes per second, best of 5 each: a copy (bytes read +
  bytes written) and a read (a sum over the array: what a decode step mostly does). The
  larger is the limit decoding is measured against."""
  n = int(gib * (1 << 30)) // 4 // 4096 * 4096
  x = jnp.arange(n, dtype=jnp.float32)
  out = {}
  for name, f, moved in (("copy", jax.jit(lambda x: x * 1.0001), 2 * n * 4),
                         # rows of 4096 summed: a row reduction, as a decode step's
                         # matrix-vector products (a sum to one scalar did not saturate an
                         # H200's memory: 2.9-3.3 TB/s where such rows read 4.5)
                         ("read", jax.jit(lambda x: jnp.sum(x.reshape(-1, 4096), axis=1)),
                          n * 4)):
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(5):
      t = time.perf_counter()
      jax.block_until_ready(f(x))
      best = min(best, time.perf_counter() - t)
    out[name] = moved / best
  del x
  return dict(out, limit=max(out.values()))


# The memory bandwidth vendors state for a device (bytes per second), by a substring of
# `jax.devices()[0].device_kind`, longest first: the goals' fractions are taken against these,
# as the published figures for other engines are. The H100 entry is the SXM part's (its kind
# reads "NVIDIA H100 80GB HBM3"); PCIe and NVL parts are listed before it.
NOMINAL_BANDWIDTH = {
    "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "H200": 4.8e12,
    "A100-SXM4-80GB": 2.039e12, "A100": 1.555e12, "L4": 0.3e12,
    "TPU v4": 1.2e12, "TPU v5 lite": 0.819e12, "TPU v5e": 0.819e12, "TPU v5p": 2.765e12,
    "TPU v6 lite": 1.64e12, "TPU v6e": 1.64e12,
}


def nominal_bandwidth(device_kind: str) -> float | None:
  """The stated bandwidth of a device kind (bytes/s), or None where the table has no entry."""
  for name in sorted(NOMINAL_BANDWIDTH, key=len, reverse=True):
    if name.lower() in device_kind.lower():
      return NOMINAL_BANDWIDTH[name]
  return None


def weight_bytes_per_step(model) -> int:
  """Bytes of weights a decode step reads: every layer weight, the final norm and the LM head
  (the tied embedding counts once, as the head); an untied embedding table is not read (one
  row per token is)."""
  p = model.params
  total = sum(x.nbytes for x in jax.tree.leaves(p.layers)) + p.final_norm.nbytes
  return total + (p.embed.nbytes if p.lm_head is None else p.lm_head.nbytes)


def kv_bytes(cfg, batch: int, positions: float) -> float:
  """Bytes of keys and values over `positions` cached tokens per row, all layers."""
  item = jnp.dtype(cfg.dtype).itemsize
  return 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * positions * item


def _copy(tree):
  return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


class Plain:
  """The `generate` loop split into its prefill and its decode loop, each compiled once."""

  def __init__(self, engine: Engine, model, prompts, new_tokens):
    prep = io.prepare_prompts(model, prompts, new_tokens)
    self.model, self.n = model, new_tokens
    b = prep.tokens.shape[0]
    self.sp = GREEDY.arrays(b)
    static = dict(lm=LlamaLM(model.cfg), max_len=prep.max_len, max_new_tokens=new_tokens,
                  stop_ids=())
    args = (model.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), self.sp,
            jax.random.key(0))
    t0 = time.perf_counter()
    self.init_exe, _ = engine.compile(plain_lib.init_decode_jit, "bench-prefill", *args, **static)
    self.state0 = jax.block_until_ready(self.init_exe(*args))
    loop_static = dict(lm=LlamaLM(model.cfg), max_new_tokens=new_tokens, stop_ids=())
    self.loop_exe, _ = engine.compile(plain_lib.decode_loop_jit, "bench-decode", model.params,
                                      self.state0, self.sp, jnp.int32(new_tokens),
                                      **loop_static)
    self.compile_seconds = time.perf_counter() - t0

  def run(self):
    """(seconds of the decode loop, steps, tokens [B, N])."""
    st = _copy(self.state0)
    t = time.perf_counter()
    st = jax.block_until_ready(self.loop_exe(self.model.params, st, self.sp, jnp.int32(self.n)))
    dt = time.perf_counter() - t
    return dt, int(st.steps), np.asarray(st.tokens)


class Spec:
  """The fused speculative loop (`speculative_generate`'s `_Run`), prefill excluded."""

  def __init__(self, engine: Engine, model, prompts, new_tokens, drafter, k):
    policy = resolve_policy(k, None, drafter)
    prep = io.prepare_prompts(model, prompts, new_tokens, extra=policy.k_max + 1)
    req = io.SpecRequest(target=model, lm=LlamaLM(model.cfg), tokenizer=model.tokenizer,
                         drafter=drafter, sampling=GREEDY, policy=policy, prep=prep,
                         stop_ids=(), max_new_tokens=new_tokens, key=jax.random.key(0), cost=None)
    t0 = time.perf_counter()
    self.run_ = runs.SpecRun(engine, req)
    self.compile_seconds = time.perf_counter() - t0
    self.state0 = jax.block_until_ready(self.run_.start())
    self.k, self.n = policy.k_max, new_tokens

  def run(self):
    """(seconds of the loop, stats dict, tokens [B, N])."""
    st = _copy(self.state0)
    t = time.perf_counter()
    st = jax.block_until_ready(self.run_.loop(st, self.run_.max_steps))
    dt = time.perf_counter() - t
    toks = loop.outputs_jit(st, self.n)[0]
    return dt, st.stats.summary(), np.asarray(toks)


def _layout(model) -> str:
  if is_scanned(model.params):
    return "stacked"
  lp = model.params.layers[0]
  names = llama_lib.OutputMajorPolicy().names  # every layer matmul weight
  om = [n for n in names if isinstance(getattr(lp, n), llama_lib.OutputMajor)]
  if not om:
    return "unrolled"
  return "unrolled-om" if len(om) == len(names) else f"unrolled-om({','.join(om)})"


def expected_tau(alpha: float, k: int) -> float:
  return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def bench_one(engine: Engine, model, batch, args, bw, log, nominal=None):
  cfg = model.cfg
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, cfg.vocab_size, args.prompt_len)) for _ in range(batch)]
  n = args.new_tokens
  res = dict(shape=args._shape, dtype=cfg.dtype, batch=batch, layout=_layout(model),
             peak=args.peak, prompt_len=args.prompt_len, new_tokens=n, k=args.k,
             alpha=args.alpha)
  plain = Plain(engine, model, prompts, n)
  res["plain_compile_seconds"] = plain.compile_seconds
  _, _, ref = plain.run()  # warm-up, and the oracle's reference
  drafter = Oracle(reference=ref, alpha=args.alpha, vocab=cfg.vocab_size)
  spec = Spec(engine, model, prompts, n, drafter, args.k)
  res["spec_compile_seconds"] = spec.compile_seconds
  spec.run()  # warm-up
  tp, ts, stats, same = [], [], None, True
  for _ in range(args.repeats):  # interleaved, so a slow spell hits both
    dt, steps, toks = plain.run()
    tp.append(dt)
    dt, stats, stoks = spec.run()
    ts.append(dt)
    same &= bool(np.array_equal(stoks, toks))
  if args.profile and not args._profiled:  # one trace of each loop, for the first config
    args._profiled = True
    with jax.profiler.trace(os.path.join(args.profile, "plain"), create_perfetto_trace=True):
      plain.run()
    with jax.profiler.trace(os.path.join(args.profile, "spec"), create_perfetto_trace=True):
      spec.run()
  if args.hlo and not args._dumped:  # the compiled programs, as the backend optimised them
    args._dumped = True
    import gzip
    os.makedirs(args.hlo, exist_ok=True)
    for name, exe in (("decode_loop", plain.loop_exe), ("spec_loop", spec.run_.loop_exe)):
      with gzip.open(os.path.join(args.hlo, f"{name}.hlo.txt.gz"), "wt") as f:
        f.write(exe.as_text())
  plain_s, spec_s = min(tp), min(ts)
  step_ms = plain_s / steps * 1e3
  ctx_avg = args.prompt_len + n / 2
  wbytes = weight_bytes_per_step(model)
  cbytes = kv_bytes(cfg, batch, ctx_avg)
  limit_ms = (wbytes + cbytes) / bw * 1e3
  widths = sorted(set([1, args.k + 1] + [w for w in args.widths if w >= 1]))
  fwd = forward_costs(model, batch, int(ctx_avg), widths, args.iters, args.rounds)
  vc = {w: fwd[w] / fwd[1] for w in widths}
  tau = stats["tau"]
  speedup = plain_s / spec_s
  ideal = tau / vc[args.k + 1]
  res.update(
      plain_ms_per_step=step_ms, plain_steps=steps, weight_gb=wbytes / 1e9,
      cache_gb_avg=cbytes / 1e9, limit_ms=limit_ms, fraction_of_limit=limit_ms / step_ms,
      fraction_of_nominal=(None if nominal is None
                           else (wbytes + cbytes) / nominal / (step_ms / 1e3)),
      forward_ms={str(w): fwd[w] * 1e3 for w in widths},
      verify_cost={str(w): vc[w] for w in widths},
      loop_overhead_ms=step_ms - fwd[1] * 1e3,
      spec_ms_per_pass=spec_s / stats["target_passes"] * 1e3,
      spec_target_passes=stats["target_passes"], tau=tau,
      tau_expected=expected_tau(args.alpha, args.k),
      acceptance_per_position=stats["conditional_acceptance_per_position"],
      speedup=speedup, ideal_speedup=ideal, machinery_efficiency=speedup / ideal,
      spec_equals_plain=same, plain_seconds=plain_s, spec_seconds=spec_s)
  log(f"{args._shape:>13} {cfg.dtype:>8} b{batch:<3} {res['layout']:>8}: plain"
      f" {step_ms:6.2f} ms/step ({res['fraction_of_limit']:.0%} of {limit_ms:.2f} ms limit"
      + ("" if nominal is None else f", {res['fraction_of_nominal']:.0%} of nominal") + "),"
      f" fwd(1) {fwd[1] * 1e3:.2f} ms, verify({args.k + 1}) {vc[args.k + 1]:.2f}x;"
      f" spec tau {tau:.2f} ({res['tau_expected']:.2f} expected), {speedup:.2f}x of ideal"
      f" {ideal:.2f}x: efficiency {speedup / ideal:.2f}; {res['spec_ms_per_pass']:.2f} ms/pass;"
      f" equal {same}")
  return res


def plot(results, path, limit_gbs=None):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels = [f"{r['shape'].replace('llama-', '')} {r['dtype'][:4]}\nb{r['batch']}"
            f" {r.get('layout', '')}" for r in results]
  x = np.arange(len(results))
  fig, ax = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(results)), 4))
  ax[0].bar(x, [r["fraction_of_limit"] for r in results])
  ax[0].axhline(0.8, ls="--", c="gray")
  ax[0].set_title("plain decode: fraction of the bandwidth limit"
                  + (f"\n(bytes per step / {limit_gbs / 1e3:.2f} TB/s)" if limit_gbs else ""))
  ax[1].bar(x - 0.2, [r["speedup"] for r in results], 0.4, label="achieved")
  ax[1].bar(x + 0.2, [r["ideal_speedup"] for r in results], 0.4, label="ideal tau / verify cost")
  ax[1].set_title("speculative speedup (oracle drafter)")
  ax[1].legend()
  for a in ax:
    a.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b",
                  help="comma-separated names from jaxspec.models.synthetic.SHAPES")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
  ap.add_argument("--configs", default="",
                  help="comma-separated shape:dtype:batch triples, instead of the product of"
                       " --shapes, --dtypes and --batch")
  ap.add_argument("--layout", default="default", choices=["default", "stacked", "unrolled",
                                                          "both"])
  ap.add_argument("--output-major", default="default",
                  help="hold unrolled matmul weights output-major (jaxspec.models.llama."
                       "OutputMajorPolicy): 'default' (the backend's), 'on' or 'off' to"
                       " compare, or weight names ('wo' or 'wo,w_down'): only those, on any"
                       " platform and dtype")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--alpha", type=float, default=0.8)
  ap.add_argument("--peak", type=float, default=None,
                  help="a peaked model of each shape (jaxspec.models.synthetic.peaked_params):"
                       " the next token wins by this many logits, so bfloat16 runs keep the"
                       " oracle's acceptance (13 gives a 128k vocabulary's top token ~0.77)")
  ap.add_argument("--nominal-gbs", type=float, default=None,
                  help="the device's stated memory bandwidth (GB/s) for fraction_of_nominal;"
                       " default: NOMINAL_BANDWIDTH by the device kind")
  ap.add_argument("--widths", default="1,2,3,5,9", help="verify widths T to time")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--iters", type=int, default=8, help="passes per timed forward call")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--bandwidth-gib", type=float, default=None,
                  help="size of the copy that measures bandwidth (default 2 GiB on"
                       " accelerators, 0.5 on CPU)")
  ap.add_argument("--options", default="",
                  help="JSON dict of XLA compiler options for the loops (a variant to compare)")
  ap.add_argument("--profile", default="",
                  help="write a jax.profiler trace of one plain and one speculative loop run"
                       " (first configuration) under this folder")
  ap.add_argument("--hlo", default="",
                  help="write the first configuration's compiled loops (HLO text) here")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "synthetic.json"))
  ap.add_argument("--plot", action="store_true")
  ap.add_argument("--limit-gbs", type=float, default=None,
                  help="with --replot: the bandwidth (GB/s) the fractions are taken against")
  ap.add_argument("--replot", nargs="*", default=None, metavar="JSON",
                  help="only plot the results of these earlier runs into --out's .png")
  args = ap.parse_args(argv)
  if args.replot:
    rows = [r for f in args.replot for r in json.load(open(f))["results"] if "speedup" in r]
    if args.limit_gbs:  # the fractions against a given bandwidth instead of each run's probe
      for r in rows:
        gb = r["weight_gb"] + r["cache_gb_avg"]
        r["fraction_of_limit"] = gb / args.limit_gbs / r["plain_ms_per_step"] * 1e3
    plot(rows, Path(args.out).with_suffix(".png"), args.limit_gbs)
    return dict(results=rows)
  args.widths = [int(w) for w in args.widths.split(",") if w]
  args._profiled = args._dumped = False
  backend = jax.default_backend()
  # The XLA options of this run's programs (per program: jaxspec's defaults stay untouched).
  engine = Engine(compiler_options={backend: json.loads(args.options)} if args.options else None)
  every = (("cpu", None), ("gpu", None))  # every float dtype
  output_major = {"default": llama_lib.DEFAULT_OUTPUT_MAJOR,
                  "on": llama_lib.OutputMajorPolicy(platforms=every),
                  "off": llama_lib.NO_OUTPUT_MAJOR}.get(args.output_major)
  if output_major is None:  # a list of weight names (the policy checks them)
    output_major = llama_lib.OutputMajorPolicy(
        platforms=every, weights=frozenset(args.output_major.split(",")))
  om_platforms = sorted(platform for platform, _ in output_major.platforms)
  gib = args.bandwidth_gib or (2.0 if backend != "cpu" else 0.5)
  bws = device_bandwidth(gib)
  bw = bws["limit"]
  kind = jax.devices()[0].device_kind
  nominal = args.nominal_gbs * 1e9 if args.nominal_gbs else nominal_bandwidth(kind)
  out = dict(machine=machine(), device_kind=kind,
             nominal_bandwidth_gbs=None if nominal is None else nominal / 1e9,
             bandwidth_gbs={k: v / 1e9 for k, v in bws.items()},
             output_major_platforms=om_platforms, args={
      k: v for k, v in vars(args).items() if not k.startswith("_")},
      output_major_weights=sorted(output_major.names) if output_major.platforms else [],
      compiler_options=engine.options(), results=[])
  print(f"{backend} ({kind}; nominal"
        f" {'unknown' if nominal is None else f'{nominal / 1e9:.0f} GB/s'}): bandwidth copy"
        f" {bws['copy'] / 1e9:.0f} GB/s, read {bws['read'] / 1e9:.0f} GB/s; output-major on"
        f" {om_platforms}; compiler options"
        f" {engine.options() or 'XLA defaults'}", flush=True)
  log = functools.partial(print, flush=True)
  layouts = {"default": [None], "stacked": [True], "unrolled": [False],
             "both": [True, False]}[args.layout]
  if args.configs:
    plan = {}
    for item in args.configs.split(","):
      shape, dtype, b = item.split(":")
      plan.setdefault((shape, dtype), []).append(int(b))
  else:
    plan = {(shape, dtype): [int(x) for x in args.batch.split(",")]
            for shape in args.shapes.split(",") for dtype in args.dtypes.split(",")}
  for (shape, dtype), batches in plan.items():
    args._shape = shape
    t0 = time.perf_counter()
    model = random_model(shape, dtype, output_major=output_major, peak=args.peak)
    log(f"{shape} {dtype}: built in {time.perf_counter() - t0:.1f} s")
    for scan in layouts:
      m = model if scan is None else dataclasses.replace(
          model, params=with_scan_layers(model.params, scan, output_major=output_major))
      for b in batches:
        try:
          out["results"].append(bench_one(engine, m, b, args, bw, log, nominal))
        except Exception as e:  # noqa: BLE001 - one failing size must not lose the others
          log(f"{shape} {dtype} b{b}: FAILED {type(e).__name__}: {e}")
          out["results"].append(dict(shape=shape, dtype=dtype, batch=b,
                                     error=f"{type(e).__name__}: {e}"))
        write_json(Path(args.out), out)
      del m
    del model
    engine.release_compiled()
  if args.plot and any("speedup" in r for r in out["results"]):
    plot([r for r in out["results"] if "speedup" in r], Path(args.out).with_suffix(".png"))
  return out


if __name__ == "__main__":
  main()
