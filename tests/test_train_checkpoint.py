"""Checkpoints (jaxattn.train.checkpoint): sharded round trip, keep-last-K, atomic commits,
corruption and mismatch errors, fallback, interrupt handling."""

import contextlib
import functools
import glob
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxattn.nn.mlp import MLP
from jaxattn.sharding import shard_module
from jaxattn.train.checkpoint import Checkpointer, CorruptCheckpointError, install_interrupt_handler

# The MLP's parameters: tests corrupt and compare by these orbax paths.
KERNEL = "model/down/kernel/value"  # [F, D]: the first matrix in path order


def _mesh():
  # Auto axes: jaxattn's modules rely on XLA's propagation inside jit (under Explicit axes the
  # MLP's down projection, a contraction over the tensor-sharded hidden axis, asks for an
  # `out_sharding`).  Checkpointing itself is indifferent to the axis types.
  return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@functools.lru_cache(maxsize=None)  # arrays are immutable: tests share one build per config
def _train_state(seed=0, hidden=16, sharded=False):
  """An NNX model (sharded by its logical axes on the 2x4 mesh when ``sharded``) and an AdamW
  state after one update, so that every optimizer leaf holds a non-trivial value."""
  mesh = _mesh() if sharded else None
  model = MLP(8, hidden, gated=False, rngs=nnx.Rngs(seed))
  with jax.set_mesh(mesh) if sharded else contextlib.nullcontext():
    if sharded:
      shard_module(model, mesh)
    # The optimizer's moments are created like the parameters, so they are sharded the same way.
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
                        wrt=nnx.Param)
    _update(model, opt, _inputs(mesh))
  return model, {"model": nnx.state(model), "opt": nnx.state(opt)}


@nnx.jit  # module level, so equal shapes and shardings reuse one compilation
def _update(model, opt, x):
  opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))


def _inputs(mesh):
  x = jnp.linspace(-1.0, 1.0, 2 * 4 * 8).reshape(2, 4, 8)  # [B, T, D]
  return x if mesh is None else jax.device_put(x, jax.NamedSharding(mesh, jax.P("data")))


def _abstract(state, sharding_of=None):
  def leaf(x):
    sharding = x.sharding if sharding_of is None else sharding_of(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(leaf, state)


def _assert_tree_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _scaled(state, factor):
  return jax.tree.map(lambda x: x * factor if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def test_sharded_round_trip_of_model_and_optimizer(tmp_path):
  mesh = _mesh()
  model, state = _train_state(sharded=True)
  kernel = state["model"]["up"]["kernel"].get_value()
  assert kernel.sharding.spec != jax.P() and len(kernel.sharding.device_set) == 8  # really sharded
  meta = {"data": {"epoch": 1, "position": 42}, "rng": [0, 7], "config": {"d": 8}}
  with Checkpointer(tmp_path / "ckpt", max_to_keep=3) as ckpt:
    assert ckpt.save(10, state, meta)
    ckpt.wait()
    assert ckpt.latest_step() == 10 and ckpt.all_steps() == [10]
  # A fresh process would do this: restore onto the abstract, sharded layout of a new model.
  fresh_model, fresh_state = _train_state(seed=1, sharded=True)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    restored, got_meta = ckpt.restore(target=_abstract(fresh_state))
  assert got_meta == meta
  _assert_tree_equal(restored, state)
  for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh_state)):
    assert r.sharding == t.sharding
  nnx.update(fresh_model, restored["model"])
  forward = nnx.jit(lambda m, x: m(x))
  with jax.set_mesh(mesh):
    x = _inputs(mesh)
    np.testing.assert_array_equal(forward(fresh_model, x), forward(model, x))


def test_restore_reshards_onto_another_layout(tmp_path):
  _, state = _train_state()  # single device
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
  mesh = jax.make_mesh((2, 4), ("data", "tensor"))  # jax's default Explicit axes this time

  def sharding_of(x):  # shard every matrix's last axis over `tensor`, replicate the rest
    spec = jax.P(*([None] * (x.ndim - 1)), "tensor") if x.ndim == 2 else jax.P()
    return jax.sharding.NamedSharding(mesh, spec)

  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(1, target=_abstract(state, sharding_of))
  _assert_tree_equal(restored, state)
  for leaf in jax.tree.leaves(restored):
    assert leaf.sharding == sharding_of(leaf)


def test_a_target_without_shardings_restores_onto_one_device(tmp_path):
  """A target from jax.eval_shape (generate's): arrays land on one local device, whatever layout
  they were saved in (orbax kept the saved 8-device layout, which fails on a machine with
  another device count, and the failure was taken for corruption)."""
  _, state = _train_state(sharded=True)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(1, target=target)
  _assert_tree_equal(restored, state)
  for leaf in jax.tree.leaves(restored):
    assert leaf.sharding == jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def test_keep_last_k_save_every_and_no_overwrite(tmp_path):
  _, state = _train_state()
  with Checkpointer(tmp_path, max_to_keep=2, save_every=2) as ckpt:
    assert not ckpt.save(3, state, {})                       # not a multiple of save_every
    for step in (2, 4, 6):
      assert ckpt.save(step, _scaled(state, step), {"step": step})
    assert ckpt.save(7, _scaled(state, 7), {"step": 7}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]
    assert not ckpt.save(7, _scaled(state, 100), {"step": 100}, force=True)  # exists: untouched
    with pytest.raises(ValueError, match=r"older than steps \[6, 7\]"):
      ckpt.save(4, state, {}, force=True)
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]           # older steps deleted, no temp dirs
  with Checkpointer(tmp_path) as ckpt:
    restored, meta = ckpt.restore(target=state)  # a concrete target works too (its shardings)
  assert meta == {"step": 7}
  _assert_tree_equal(restored, _scaled(state, 7))


def test_missing_and_empty_directories(tmp_path):
  _, state = _train_state()
  missing = tmp_path / "never_written"
  ckpt = Checkpointer(missing)
  assert ckpt.latest_step() is None and ckpt.all_steps() == []
  with pytest.raises(FileNotFoundError, match=f"{missing}.*does not exist"):
    ckpt.restore(target=_abstract(state))
  assert not missing.exists()                                 # reading never creates it
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=f"no checkpoints in {tmp_path / 'empty'}"):
    Checkpointer(tmp_path / "empty").restore(target=_abstract(state))
  with Checkpointer(tmp_path / "one") as ckpt:
    ckpt.save(5, state, {})
    with pytest.raises(FileNotFoundError, match=r"no step 6 .*\[5\]"):
      ckpt.restore(6, target=_abstract(state))


def test_argument_errors(tmp_path):
  _, state = _train_state()
  with pytest.raises(ValueError, match="max_to_keep"):
    Checkpointer(tmp_path, max_to_keep=0)
  with pytest.raises(ValueError, match="save_every"):
    Checkpointer(tmp_path, save_every=0)
  ckpt = Checkpointer(tmp_path)
  with pytest.raises(ValueError, match="JSON-serializable"):
    ckpt.save(1, state, {"key": jax.random.key(0)})
  with pytest.raises(ValueError, match="`step` must be an int"):
    ckpt.save(-1, state, {})
  ckpt.close()


def test_structure_mismatch_names_the_parameter(tmp_path):
  _, state = _train_state(hidden=16)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
  # The same model and optimizer with hidden size 32 instead of 16.
  wider = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(tuple(32 if d == 16 else d for d in x.shape), x.dtype), state)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(ValueError, match=rf"'{KERNEL}' is shape \(16, 8\).*\(32, 8\)"):
      ckpt.restore(target=wider)
    with pytest.raises(ValueError, match=r"'model/extra/value' is not in checkpoint step 1"):
      target = _abstract(state)
      target["model"]["extra"] = nnx.Param(jax.ShapeDtypeStruct((3,), jnp.float32))
      ckpt.restore(target=target)
    with pytest.raises(ValueError, match=r"holds parameter 'opt/.*' that the target lacks"):
      ckpt.restore(target={"model": _abstract(state)["model"]})
    with pytest.raises(ValueError, match=rf"'{KERNEL}' is shape \(16, 8\) dtype float32.*bfloat16"):
      ckpt.restore(target=jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) if x.ndim == 2 else x,
          _abstract(state)))


def _corrupt(directory, step, how):
  step_dir = os.path.join(directory, str(step))
  if how == "delete_arrays":
    files = [f for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True) if os.path.isfile(f)]
    assert files
    for f in files:
      os.remove(f)
  elif how == "truncate_arrays":
    for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True):
      with open(f, "r+b") as fh:
        fh.truncate(max(0, os.path.getsize(f) // 3))
  elif how == "garbage_metadata":
    with open(f"{step_dir}/state/_METADATA", "w") as fh:
      fh.write("{not json")
  elif how == "garbage_meta_item":
    with open(f"{step_dir}/meta/metadata", "w") as fh:
      fh.write("\x00\x01garbage")
  else:
    raise AssertionError(how)


# Reading a damaged checkpoint makes orbax / tensorstore leave an async callback behind that fails
# later with "Event loop is closed"; that is their cleanup noise, not a failure of these tests.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["delete_arrays", "truncate_arrays", "garbage_metadata",
                                 "garbage_meta_item"])
def test_corrupted_latest_errors_and_falls_back(tmp_path, how):
  _, state = _train_state()
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    ckpt.save(1, _scaled(state, 1), {"step": 1})
    ckpt.save(2, _scaled(state, 2), {"step": 2})
  _corrupt(tmp_path, 2, how)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CorruptCheckpointError, match=f"step 2 in {tmp_path} is corrupted") as e:
      ckpt.restore(target=_abstract(state))
    assert e.value.step == 2 and isinstance(e.value, ValueError)
    assert "tensorstore_spec" not in str(e.value)             # the cause, not a spec dump
    assert ckpt.all_steps() == [1, 2]                          # a failed restore changes nothing
    restored, meta = ckpt.restore(target=_abstract(state), fallback=True, quarantine=False)
    assert meta == {"step": 1} and ckpt.all_steps() == [1, 2]  # a reader moves nothing aside
    restored, meta = ckpt.restore(target=_abstract(state), fallback=True)
    assert meta == {"step": 1}
    _assert_tree_equal(restored, _scaled(state, 1))
    # The corrupted step is kept aside, so training can write step 2 again.
    assert ckpt.all_steps() == [1]
    assert [p for p in os.listdir(tmp_path) if p.startswith("2.corrupted-")]
    assert ckpt.save(2, _scaled(state, 5), {"step": 2})
  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(target=_abstract(state))
  _assert_tree_equal(restored, _scaled(state, 5))


@pytest.mark.parametrize("error", [MemoryError("host"), TimeoutError("gcs"),
                                   RuntimeError("RESOURCE_EXHAUSTED: Out of memory")])
def test_a_machine_failure_during_restore_is_not_corruption(tmp_path, monkeypatch, error):
  """Out of memory or a network timeout while reading is re-raised as is: with fallback, calling
  it corruption would restore an older step and move the good newest one aside."""
  _, state = _train_state()
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    ckpt.save(1, _scaled(state, 1), {"step": 1})
    ckpt.save(2, _scaled(state, 2), {"step": 2})
  import orbax.checkpoint as ocp

  def failing_restore(self, *a, **k):
    raise error

  monkeypatch.setattr(ocp.CheckpointManager, "restore", failing_restore)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(type(error)):
      ckpt.restore(target=_abstract(state), fallback=True)
    assert ckpt.all_steps() == [1, 2]
  assert not [p for p in os.listdir(tmp_path) if ".corrupted-" in p]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_saving_after_a_corrupted_latest_keeps_the_older_good_step(tmp_path):
  _, state = _train_state()
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    ckpt.save(1, _scaled(state, 1), {"step": 1})
    ckpt.save(2, _scaled(state, 2), {"step": 2})
    ckpt.wait()
    _corrupt(tmp_path, 2, "delete_arrays")
    ckpt.save(3, _scaled(state, 3), {"step": 3})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3]
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.restore(1, target=_abstract(state))[1] == {"step": 1}
    assert ckpt.restore(3, target=_abstract(state))[1] == {"step": 3}
    with pytest.raises(CorruptCheckpointError):
      ckpt.restore(2, target=_abstract(state))
    # Every step corrupted: the error says so instead of returning garbage.
    _corrupt(tmp_path, 1, "garbage_metadata")
    with pytest.raises(CorruptCheckpointError, match=r"no readable step among \[2, 1\]"):
      ckpt.restore(2, target=_abstract(state), fallback=True)


def test_an_interrupted_write_is_invisible_and_does_not_block_the_next_save(tmp_path):
  _, state = _train_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, _scaled(state, 1), {"step": 1})
    ckpt.save(2, _scaled(state, 2), {"step": 2})
  # A crash in the middle of writing step 3: orbax writes into a temporary directory and renames
  # it to `3` only on commit, so a half-written step looks like this on disk.
  shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp")
  _corrupt(tmp_path, "3.orbax-checkpoint-tmp", "truncate_arrays")
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [1, 2] and ckpt.latest_step() == 2
    restored, meta = ckpt.restore(target=_abstract(state))
    assert meta == {"step": 2}
    _assert_tree_equal(restored, _scaled(state, 2))
    assert ckpt.save(3, _scaled(state, 3), {"step": 3})     # the stale temp dir is replaced
  with Checkpointer(tmp_path) as ckpt:
    restored, meta = ckpt.restore(target=_abstract(state))
  assert meta == {"step": 3}
  _assert_tree_equal(restored, _scaled(state, 3))
  assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


def test_a_step_is_written_under_a_temporary_name_and_renamed_on_commit(tmp_path, monkeypatch):
  """Checks the mechanism the safety rests on: orbax's atomic-rename commit, observed in action."""
  atomicity = pytest.importorskip("orbax.checkpoint").path.atomicity
  if not hasattr(atomicity, "AtomicRenameTemporaryPath"):
    pytest.skip("this orbax commits differently; re-verify the atomic commit")
  cls = atomicity.AtomicRenameTemporaryPath
  original = cls.finalize
  seen = []

  async def spy(self, *args, **kwargs):
    # The moment before the commit: everything is written under the temporary name only.
    tmp = self.get()
    if tmp.name.startswith("1."):  # the step directory (items inside commit the same way)
        seen.append(dict(tmp=str(tmp.name), final_exists=(tmp_path / "1").exists(),
                       files=sorted(os.listdir(tmp)), state_files=len(os.listdir(tmp / "state"))))
    return await original(self, *args, **kwargs)

  monkeypatch.setattr(cls, "finalize", spy)
  _, state = _train_state()
  with Checkpointer(tmp_path, async_save=True) as ckpt:
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
  assert len(seen) == 1
  assert seen[0]["tmp"].startswith("1.orbax-checkpoint-tmp") and not seen[0]["final_exists"]
  assert {"state", "meta"} <= set(seen[0]["files"]) and seen[0]["state_files"] > 0
  assert os.listdir(tmp_path) == ["1"]                          # renamed; nothing left behind


def test_interrupt_handler_sets_a_flag_then_restores_handlers():
  before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  seen = []
  with install_interrupt_handler(seen.append) as interrupt:
    assert not interrupt
    os.kill(os.getpid(), signal.SIGTERM)
    assert interrupt and interrupt.signum == signal.SIGTERM and seen == [signal.SIGTERM]
  assert signal.getsignal(signal.SIGINT) is before_int
  assert signal.getsignal(signal.SIGTERM) is before_term
  with install_interrupt_handler() as interrupt:
    os.kill(os.getpid(), signal.SIGINT)                       # first Ctrl-C: a request
    assert interrupt.requested and interrupt.signum == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):                    # second Ctrl-C: stop now
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before_int


def test_data_position_and_rng_resume_through_a_checkpoint(tmp_path):
  """What the train loop stores in `meta` comes back so that the next batches and keys match."""
  from jaxattn.train.data import PackedDataset

  docs = [np.arange(3, 3 + n, dtype=np.int32) for n in (5, 17, 9, 30)]
  data = PackedDataset(docs, batch_size=2, seq_len=8, seed=4)
  key = jax.random.key(3)
  for _ in range(5):
    next(data)
    key, _ = jax.random.split(key)
  _, state = _train_state()
  meta = {"data": data.state(), "rng": jax.random.key_data(key).tolist()}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(5, state, meta)
  expected = [next(data) for _ in range(3)]
  with Checkpointer(tmp_path) as ckpt:
    _, got = ckpt.restore(target=_abstract(state))
  resumed = PackedDataset(docs, batch_size=2, seq_len=8, seed=4)
  resumed.restore(got["data"])
  for want in expected:
    batch = next(resumed)
    for k in want:
      np.testing.assert_array_equal(batch[k], want[k])
  restored_key = jax.random.wrap_key_data(jnp.asarray(got["rng"], jnp.uint32))
  np.testing.assert_array_equal(jax.random.key_data(restored_key), jax.random.key_data(key))


def _assert_keys_and_arrays_equal(restored, state):
  """Same tree, dtypes and shapes; typed PRNG keys compared by their key data."""
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    assert got.dtype == want.dtype and got.shape == want.shape
    if jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
      want, got = jax.random.key_data(want), jax.random.key_data(got)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_state_with_typed_prng_keys_round_trips(tmp_path):
  """nnx RNG state (dropout's `rngs`: a `key<fry>` leaf and a uint32 count) is saved as raw key
  data; the structure check compares a key leaf by that key data (it raised TypeError on the key
  dtype, then reported a false shape mismatch), and the keys come back as typed keys."""

  class Net(nnx.Module):
    def __init__(self, seed):
      self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))
      self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=seed + 7))

  net = Net(0)
  net.drop(jnp.ones((2, 4)))                                  # advance the count: a non-zero value
  state = nnx.state(net)
  keys = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
  assert keys                                                 # the test holds a typed key leaf
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
  for target in (_abstract(state), jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                state)):
    with Checkpointer(tmp_path) as ckpt:
      restored, _ = ckpt.restore(1, target=target)
    _assert_keys_and_arrays_equal(restored, state)
  # The restored RNG state draws the same dropout masks as the saved one (another seed does not).
  fresh, x = Net(1), jnp.ones((4, 64))
  assert not np.array_equal(np.asarray(fresh.drop(x)), np.asarray(Net(0).drop(x)))
  nnx.update(fresh, restored)
  np.testing.assert_array_equal(np.asarray(fresh.drop(x)), np.asarray(net.drop(x)))
  # A key of another implementation (other key data: uint32 (4,)) is a real mismatch.
  rbg = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jax.random.key(0, impl="rbg").dtype)
      if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, _abstract(state))
  with Checkpointer(tmp_path) as ckpt, pytest.raises(
      ValueError, match=r"is shape \(2,\) dtype uint32 .* shape \(4,\) dtype uint32"):
    ckpt.restore(1, target=rbg)


@pytest.mark.parametrize("scan", [False, True])
def test_a_train_state_with_lora_dropout_rngs_resumes(tmp_path, scan):
  """The case that failed: make_train_step's LoRA-with-dropout state carries the adapters' RNG
  state in `rest`; it could be saved but never restored (TypeError on `key<fry>`)."""
  from jaxattn.configs import get_config
  from jaxattn.nn.lora import apply_lora
  from jaxattn.nn.model import DecoderLM
  from jaxattn.train.step import init_train_state, make_optimizer

  cfg = get_config("llama", embed_dim=16, mlp_dim=32, num_layers=2, num_heads=2, max_seq_len=32,
                   scan_layers=scan)
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  apply_lora(model, r"mixer/(q|v)_proj$", rank=2, dropout=0.5, rngs=nnx.Rngs(1))
  _, state = init_train_state(model, make_optimizer(learning_rate=1e-2, warmup_steps=0,
                                                    total_steps=10))
  keys = [x for x in jax.tree.leaves(state.rest) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
  # one key per adapter (q, v) and layer: 4 scalar keys, or 2 keys stacked over the 2 layers
  assert [k.shape for k in keys] == ([(2,)] * 2 if scan else [()] * 4)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(target=_abstract(state))
  _assert_keys_and_arrays_equal(restored, state)
