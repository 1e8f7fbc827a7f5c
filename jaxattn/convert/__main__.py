"""``python -m jaxattn.convert --from-hf PATH --out CHECKPOINT [--dtype bfloat16]``.

Reads a transformers ``save_pretrained`` directory (config.json + safetensors or
pytorch_model.bin), converts it (refusing configs it does not fully understand) and writes the
orbax checkpoint that ``jaxattn.convert.load_checkpoint`` reads.
"""

from __future__ import annotations

import argparse
import sys

from jaxattn.convert.checkpoint import save_checkpoint
from jaxattn.convert.hf import dtype_names, load_hf


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxattn.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--from-hf", required=True, metavar="PATH",
                      help="a transformers save_pretrained directory")
  parser.add_argument("--out", required=True, metavar="CHECKPOINT",
                      help="directory to write (config.json + orbax state); must not exist")
  parser.add_argument("--dtype", default="float32", choices=dtype_names(),
                      help="parameter storage and compute dtype (default float32)")
  args = parser.parse_args(argv)
  model = load_hf(args.from_hf, dtype=args.dtype)
  save_checkpoint(model, args.out)
  cfg = model.config
  print(f"wrote {args.out}: {cfg.num_layers} layers, pattern {cfg.layer_pattern!r}, "
        f"{cfg.num_experts} experts, param_dtype {cfg.param_dtype}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
