"""Native CPU kernels: C++ sources compiled on first use and called through XLA's FFI.

XLA:CPU runs each op of a loop body as its own parallel kernel; the hot loops of attention need
the opposite (a block of logits kept in cache across two matmuls and a softmax, independent
query blocks on independent cores), so they are written in C++ (``*.cc`` next to this file) and
registered as FFI custom calls (``jax.ffi``).

The first use compiles them with the system C++ compiler (``$CXX``, else ``c++`` / ``g++`` /
``clang++``) against the FFI headers that jaxlib ships, with ``-O3 -march=native``, into a cache
directory (``$JAXATTN_CACHE_DIR``, else ``~/.cache/jaxattn``).  The library file's name hashes the
source, the jaxlib version, the compiler and the CPU, so an upgrade or another machine sharing the
directory rebuilds.  ``JAXATTN_NATIVE=0`` disables the kernels.  Where they cannot be built (no
compiler) ``available()`` is False, ``reason()`` says why, and the callers fall back to XLA.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

_SOURCES = ("flash_attention.cc", "sparse.cc")
_HEADERS = ("common.h",)
# Handler symbols in the library, registered as FFI targets of the same names.
_TARGETS = ("jaxattn_flash_attention_fwd_f32", "jaxattn_flash_attention_bwd_f32",
            "jaxattn_indexer_topk_f32",
            "jaxattn_sparse_attention_f32")
_FLAGS = ("-O3", "-march=native", "-std=gnu++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict = {}


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cpu_signature() -> str:
  sig = [platform.machine()]
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("model name", "flags", "Features")):
          sig.append(line.strip())
        if len(sig) >= 3:
          break
  except OSError:
    sig.append(platform.processor())
  return "\n".join(sig)


def _cache_dir() -> Path:
  root = os.environ.get("JAXATTN_CACHE_DIR") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxattn")
  return Path(root) / "native"


def _build(cxx: str, *, rebuild: bool = False) -> Path:
  """The cached library for this source, compiler and CPU (compiled first when missing, or when
  ``rebuild``: a cached copy that would not load)."""
  import jaxlib  # noqa: PLC0415

  here = Path(__file__).parent
  src = [here / name for name in _SOURCES]
  include = jax.ffi.include_dir()
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
  h = hashlib.sha256()
  for part in [(here / p).read_bytes() for p in _SOURCES + _HEADERS] + [s.encode() for s in (
      jaxlib.__version__, version, _cpu_signature(), " ".join(_FLAGS))]:
    h.update(part)
  out_dir = _cache_dir()
  lib = out_dir / f"jaxattn_native-{h.hexdigest()[:16]}.so"
  if lib.exists() and not rebuild:
    st = lib.stat()
    if st.st_mode & 0o755 != 0o755 and st.st_uid == os.getuid():
      try:                          # built by an older version, 0711: let other users read it
        os.chmod(lib, 0o755)
      except OSError:               # (a read-only cache: we can still load it ourselves)
        pass
    return lib
  out_dir.mkdir(parents=True, exist_ok=True)
  logging.getLogger("jaxattn").info("compiling the native CPU kernels into %s (once, ~10 s)", lib)
  # Build into a temporary name, then rename: concurrent processes never load a partial file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  cmd = [cxx, *_FLAGS, f"-I{include}", *map(str, src), "-o", tmp]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    os.unlink(tmp)
    raise RuntimeError(f"compiling the native kernels failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
  # mkstemp made the file 0600 and the linker keeps that: other users sharing the cache
  # directory found it, skipped the build and could not load it.
  os.chmod(tmp, 0o755)
  os.replace(tmp, lib)
  return lib


def _load() -> None:
  if os.environ.get("JAXATTN_NATIVE", "1") == "0":
    _state["reason"] = "disabled by JAXATTN_NATIVE=0"
    return
  cxx = _compiler()
  if cxx is None:
    _state["reason"] = "no C++ compiler found (set $CXX)"
    return
  try:
    path = _build(cxx)
    try:
      lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:  # an unreadable or damaged cached copy: compile it again, once
      logging.getLogger("jaxattn").warning("the cached native library %s did not load (%s); "
                                           "compiling it again", path, e)
      path = _build(cxx, rebuild=True)
      lib = ctypes.cdll.LoadLibrary(str(path))
    for name in _TARGETS:
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
  except (OSError, RuntimeError, AttributeError) as e:
    _state["reason"] = str(e)
    return
  _state["lib"] = lib
  _state["path"] = path


def available() -> bool:
  """True when the native kernels are built, loaded and registered (builds them on first call)."""
  with _lock:
    if not _state:
      _load()
  return "lib" in _state


def reason() -> str:
  """Why the native kernels are unavailable ('' when they are available)."""
  return "" if available() else _state.get("reason", "unknown")


def library_path() -> Path | None:
  """The loaded shared library (None when unavailable)."""
  return _state.get("path") if available() else None


__all__ = ["available", "reason", "library_path"]
