"""Checkpoints for training: a thin layer over ``orbax.checkpoint.CheckpointManager``.

A checkpoint of step ``s`` is the directory ``<directory>/<s>/`` with two items: ``state`` (any
pytree of arrays -- e.g. ``nnx.state`` of the model and of the optimizer -- written with
``StandardSave``) and ``meta`` (a JSON dict: data-iterator state, RNG seeds as ints, the config).

What this layer adds to orbax, and why:

* Atomic commits are orbax's: a step is written to ``<s>.orbax-checkpoint-tmp...`` and renamed to
  ``<s>`` only once every file is written (on object stores, a ``commit_success.txt`` marks it), and
  steps are discovered from committed names only, so a crash mid-save leaves the previous
  checkpoints as they were.  Old steps beyond ``max_to_keep`` are deleted only after the new step
  has committed (orbax's finalize waits for the commit and stops on a failed write).
* ``save`` never overwrites: a step that exists is left alone (``save`` returns False), and saving
  below a newer step that exists is refused, since the two would belong to different histories.
* ``restore`` checks the saved tree against the target before reading any array and names the
  first parameter path that is missing, extra, or of another shape or dtype; a checkpoint that
  cannot be read (deleted or truncated array files, garbage metadata) raises
  :class:`CorruptCheckpointError` naming the step and the cause, and ``fallback=True`` restores the
  newest readable older step instead.
* :func:`install_interrupt_handler` turns SIGINT / SIGTERM into a flag the train loop polls, so it
  saves and exits cleanly instead of dying mid-step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

_log = logging.getLogger(__name__)

_STATE, _META = "state", "meta"


class CorruptCheckpointError(ValueError):
  """A committed checkpoint step that cannot be read back."""

  def __init__(self, directory: str, step: int, cause: str):
    self.directory, self.step, self.cause = directory, step, cause
    super().__init__(f"checkpoint step {step} in {directory} is corrupted or unreadable: {cause}")


def _to_abstract(x: Any) -> Any:
  """Concrete jax arrays -> ``ShapeDtypeStruct`` carrying their sharding (restore lays arrays out
  the same way); abstract leaves and NumPy arrays pass through."""
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  if isinstance(x, jax.ShapeDtypeStruct) and getattr(x, "sharding", None) is None:
    # A target from jax.eval_shape carries no sharding, and orbax would then lay the arrays out
    # as they were saved: a checkpoint written on another device count fails to restore.
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  return x


def _cause(e: BaseException) -> str:
  """``Type: message`` without the kilobyte-long spec dump tensorstore appends to its errors."""
  message = re.split(r"\s*\[tensorstore_spec=", str(e))[0].strip()
  return f"{type(e).__name__}: {message}"


def _not_corruption(e: BaseException) -> bool:
  """A failure of this machine, not of the checkpoint: out of host or device memory, or a file
  system / network error that names no damaged file (a timeout, a refused connection, a permission
  denied).  Re-raised as is: calling such a step corrupted would move good checkpoints aside."""
  if isinstance(e, (MemoryError, PermissionError, TimeoutError, ConnectionError)):
    return True
  text = str(e)
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory",
                                 "DEADLINE_EXCEEDED", "UNAVAILABLE:", "PERMISSION_DENIED"))


def _key_name(k: Any) -> str:
  """A jax key-path entry as orbax names it in its flat paths."""
  for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _describe(x: Any) -> tuple[tuple[int, ...], np.dtype] | None:
  """``(shape, dtype)`` of a leaf as orbax stores it.  A typed PRNG key (``key<fry>``, e.g. the
  nnx RNG state of dropout) is stored as its raw key data -- ``uint32 (*shape, 2)`` for threefry
  -- and has no NumPy dtype, so it is described by that key data: the target's key leaf and the
  saved array then compare equal, and a key of another implementation (other key data) does not."""
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  if shape is None or dtype is None:
    return None
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype))
    shape, dtype = x.shape, x.dtype
  return tuple(shape), np.dtype(dtype)


class Checkpointer:
  """Saves and restores ``(state pytree, JSON meta)`` per training step.

  Args:
    directory: where the step directories live.  It is created by the first ``save``; reading a
      directory that does not exist raises ``FileNotFoundError`` naming it.
    max_to_keep: how many of the newest steps to keep (older ones are deleted after a newer one
      commits); ``None`` keeps all.
    save_every: ``save(step, ...)`` writes only when ``step % save_every == 0`` (or ``force``).
    async_save: write in a background thread so training continues; ``save`` still waits for the
      previous write first, and ``wait()`` / ``close()`` wait for the last one.

  Call from every host of a multi-host job (orbax coordinates who writes what).
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               save_every: int = 1, async_save: bool = True):
    if max_to_keep is not None and int(max_to_keep) < 1:
      raise ValueError(f"Checkpointer: `max_to_keep` must be >= 1 or None, got {max_to_keep!r}.")
    if int(save_every) < 1:
      raise ValueError(f"Checkpointer: `save_every` must be >= 1, got {save_every!r}.")
    # orbax requires absolute paths; keep remote URLs (gs://...) as they are.
    directory = os.fspath(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self.max_to_keep = None if max_to_keep is None else int(max_to_keep)
    self.save_every = int(save_every)
    self.async_save = bool(async_save)
    self._mngr: ocp.CheckpointManager | None = None

  # -- the orbax manager, created lazily so that reading never creates the directory ------------

  def _manager(self, *, create: bool) -> ocp.CheckpointManager | None:
    if self._mngr is None:
      if not create and not epath.Path(self.directory).is_dir():
        return None
      options = ocp.CheckpointManagerOptions(
          max_to_keep=self.max_to_keep, save_interval_steps=1, create=True,
          enable_async_checkpointing=self.async_save)
      # Handlers named up front: a fresh manager can then read a step's metadata (the structure
      # check) before anything was saved or restored through it.
      self._mngr = ocp.CheckpointManager(
          self.directory, options=options,
          item_handlers={_STATE: ocp.StandardCheckpointHandler(),
                         _META: ocp.JsonCheckpointHandler()})
    return self._mngr

  def all_steps(self) -> list[int]:
    """Saved steps, ascending.  An async save counts from when it starts; ``wait()`` first to
    know it committed (a failed write raises there and is dropped from the list)."""
    mngr = self._manager(create=False)
    return sorted(mngr.all_steps()) if mngr is not None else []

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    return int(step) % self.save_every == 0

  def save(self, step: int, state: Any, meta: dict[str, Any] | None = None, *,
           force: bool = False) -> bool:
    """Writes ``state`` (pytree of arrays) and ``meta`` (JSON dict) as step ``step``.

    Returns whether a checkpoint was started: False when ``step`` is not a multiple of
    ``save_every`` (unless ``force``) or when step ``step`` already exists (never overwritten --
    e.g. a forced save on interrupt right after resuming from that very step).
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"Checkpointer.save: `step` must be an int >= 0, got {step!r}.")
    step = int(step)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
      raise ValueError(f"Checkpointer.save: `meta` must be a dict, got {type(meta).__name__}.")
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise ValueError(f"Checkpointer.save: `meta` must be JSON-serializable (store RNG keys as "
                       f"ints, arrays as lists): {e}") from e
    if not force and not self.should_save(step):
      return False
    mngr = self._manager(create=True)
    # Finish (and surface errors of) the previous async write before deciding anything.
    mngr.wait_until_finished()
    steps = sorted(mngr.all_steps())
    if step in steps:
      _log.info("checkpoint step %d already exists in %s; not overwriting it", step, self.directory)
      return False
    newer = [s for s in steps if s > step]
    if newer:
      raise ValueError(f"Checkpointer.save: step {step} is older than steps {newer} already in "
                       f"{self.directory}; saving it would mix two training histories (and "
                       "keep-last-K could delete it at once). Restore the newest step, or move "
                       "the newer steps away, or use another directory.")
    return bool(mngr.save(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)}), force=True))

  def wait(self) -> None:
    """Blocks until the last async save has committed; raises if it failed."""
    if self._mngr is not None:
      self._mngr.wait_until_finished()

  def close(self) -> None:
    """Waits for pending writes and releases orbax's threads."""
    if self._mngr is not None:
      self._mngr.close()
      self._mngr = None

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- restore ----------------------------------------------------------------------------------

  def restore(self, step: int | None = None, *, target: Any, fallback: bool = False,
              quarantine: bool = True) -> tuple[Any, dict[str, Any]]:
    """Restores ``(state, meta)`` of ``step`` (default: the newest) into the layout of ``target``.

    Args:
      step: the step to read; ``None`` for the newest committed one.
      target: a pytree with the structure of the saved state whose leaves are
        ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` or concrete ``jax.Array`` s (their
        sharding is used): restored arrays are placed with those shardings, so a sharded run
        resumes sharded.  E.g. ``jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
        sharding=x.sharding), state)``, or ``nnx.eval_shape`` + shardings.
      fallback: if the chosen step is corrupted, restore the newest readable older step instead
        (a warning names each skipped step).  Corrupted steps newer than the restored one are then
        renamed to ``<step>.corrupted-<unix time>`` (kept for inspection, never deleted), so that
        training can save those step numbers again.
      quarantine: with ``fallback``, whether to move those steps aside; a reader that does not
        own the run (generation, evaluation) passes False and leaves the directory as it is.

    Raises:
      FileNotFoundError: the directory does not exist, holds no checkpoint, or lacks ``step``.
      ValueError: the saved tree does not match ``target`` (names the parameter path).
      CorruptCheckpointError: the step cannot be read (and no older one can, with ``fallback``).
        Running out of memory or a network / permission failure while reading is not corruption:
        that error propagates as is, and no step is skipped or moved aside.
    """
    mngr = self._manager(create=False)
    if mngr is None:
      raise FileNotFoundError(f"Checkpointer.restore: checkpoint directory {self.directory} does "
                              "not exist.")
    mngr.wait_until_finished()
    mngr.reload()  # another process (or a previous run) may have written steps since
    steps = sorted(mngr.all_steps())
    if not steps:
      raise FileNotFoundError(f"Checkpointer.restore: no checkpoints in {self.directory}.")
    if step is not None and int(step) not in steps:
      raise FileNotFoundError(f"Checkpointer.restore: no step {step} in {self.directory}; "
                              f"committed steps are {steps}.")
    first = steps[-1] if step is None else int(step)
    candidates = [s for s in reversed(steps) if s <= first]
    abstract = jax.tree.map(_to_abstract, target)
    skipped: list[int] = []
    for s in candidates:
      try:
        result = self._restore_step(mngr, s, abstract)
      except CorruptCheckpointError as e:
        if not fallback:
          raise
        _log.warning("%s; falling back to an older step", e)
        skipped.append(s)
        continue
      if skipped and quarantine:
        self._quarantine(mngr, skipped)
      return result
    raise CorruptCheckpointError(self.directory, candidates[-1],
                                 f"no readable step among {candidates} (all corrupted)")

  def _restore_step(self, mngr: ocp.CheckpointManager, step: int, abstract: Any
                    ) -> tuple[Any, dict[str, Any]]:
    try:
      saved = mngr.item_metadata(step)[_STATE]
      if saved is None:
        raise ValueError("the `state` item has no metadata")
      # orbax >= 0.12 wraps the tree in a TreeMetadata; older releases return the tree itself.
      saved_flat = ocp.tree.to_flat_dict(getattr(saved, "tree", saved))
    except Exception as e:  # noqa: BLE001 -- any other failure to read metadata is corruption
      if _not_corruption(e):
        raise
      raise CorruptCheckpointError(self.directory, step,
                                   f"cannot read the state metadata ({_cause(e)})") from e
    self._check_structure(step, saved_flat, abstract)
    try:
      restored = mngr.restore(step, args=ocp.args.Composite(
          **{_STATE: ocp.args.StandardRestore(abstract), _META: ocp.args.JsonRestore()}))
      state, meta = restored[_STATE], restored[_META]
      if meta is None:
        raise ValueError("the `meta` item is missing")
    except Exception as e:  # noqa: BLE001 -- the tree matched, so a read failure is corruption
      if _not_corruption(e):
        raise
      if "opology mismatch" in str(e):  # a layout the target asks for, not a damaged checkpoint
        raise ValueError(f"Checkpointer.restore: step {step} in {self.directory} cannot be laid "
                         f"out as the target asks ({_cause(e)}); give the target shardings for "
                         "this machine's devices.") from e
      raise CorruptCheckpointError(self.directory, step, f"reading it failed ({_cause(e)})") from e
    return state, meta

  def _check_structure(self, step: int, saved_flat: dict, abstract: Any) -> None:
    target_flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract, keep_empty_nodes=True))
    # orbax sorts keys; report in the target's own leaf order so the first path named is the
    # first parameter that differs (the model's, not its Adam moment's).
    rank = {tuple(_key_name(k) for k in path): i
            for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(abstract)[0])}
    target_flat = dict(sorted(target_flat.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    name = "/".join
    where = f"checkpoint step {step} in {self.directory}"
    # Reported in the target's own leaf order, so the first named path is the first parameter.
    missing = [p for p in target_flat if p not in saved_flat]
    if missing:
      raise ValueError(f"Checkpointer.restore: target parameter {name(missing[0])!r} is not in "
                       f"{where} ({len(missing)} target paths missing, e.g. "
                       f"{[name(p) for p in missing[:3]]}); the model differs from the saved one.")
    extra = [p for p in saved_flat if p not in target_flat]
    if extra:
      raise ValueError(f"Checkpointer.restore: {where} holds parameter {name(extra[0])!r} that the "
                       f"target lacks ({len(extra)} such paths, e.g. "
                       f"{[name(p) for p in extra[:3]]}); the model differs from the saved one.")
    for path in target_flat:
      want, have = _describe(target_flat[path]), _describe(saved_flat[path])
      if want is not None and have is not None and want != have:
        raise ValueError(f"Checkpointer.restore: parameter {name(path)!r} is shape {have[0]} dtype "
                         f"{have[1]} in {where} but shape {want[0]} dtype {want[1]} in the target.")

  def _quarantine(self, mngr: ocp.CheckpointManager, steps: list[int]) -> None:
    if jax.process_index() == 0:
      stamp = int(time.time())
      for s in steps:
        src = epath.Path(self.directory) / str(s)
        dst = src.parent / f"{src.name}.corrupted-{stamp}"
        src.rename(dst)  # epath: also on object stores such as gs://
        _log.warning("moved corrupted checkpoint step %d aside to %s", s, dst)
    if jax.process_count() > 1:
      ocp.multihost.sync_global_processes("jaxattn_checkpoint_quarantine")
    mngr.reload()


@dataclasses.dataclass
class Interrupt:
  """Set by the handler of :func:`install_interrupt_handler`; the train loop polls ``requested``."""

  requested: bool = False
  signum: int | None = None

  def __bool__(self) -> bool:
    return self.requested


@contextlib.contextmanager
def install_interrupt_handler(callback: Callable[[int], None] | None = None,
                              signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
                              ) -> Iterator[Interrupt]:
  """Within the block, SIGINT / SIGTERM set a flag (and call ``callback(signum)``) instead of
  killing the process, so the loop can finish its step, save and exit cleanly::

    with install_interrupt_handler() as interrupt:
      for step in ...:
        train_step(...)
        if interrupt:
          ckpt.save(step, state, meta, force=True); break

  A second SIGINT while the first is pending raises ``KeyboardInterrupt`` (an impatient user can
  still stop a hung job).  The previous handlers come back on exit.  Must run in the main thread
  (Python delivers signals only there).
  """
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("install_interrupt_handler must be called from the main thread; Python "
                       "delivers signals only there.")
  flag = Interrupt()

  def handler(signum, frame):
    if flag.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    flag.requested, flag.signum = True, signum
    _log.warning("received %s; finishing the current step, then saving and stopping",
                 signal.Signals(signum).name)
    if callback is not None:
      callback(signum)

  previous = {s: signal.signal(s, handler) for s in signals}
  try:
    yield flag
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
